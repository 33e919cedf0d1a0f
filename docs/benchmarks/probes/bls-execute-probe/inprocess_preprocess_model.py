"""PROBE (not shipped): the pipeline with preprocess in its own process, as the top-k already is: one BLS call
(resnet) per execute instead of two, to measure what the preprocess hop costs (a BLS round trip of ~1 ms and the
preprocess model's queue), against what is lost (preprocess's dynamic batching across pipeline instances, and
each of the 16 pipeline stubs holds nvJPEG and decode memory of its own).

The shipped async execute, give-up included; the per-request retry of a bad image is kept (Preprocess.batch fails
only the request with the bad image). Install in a bake: copy over model_repository/pipeline/1/model.py."""

from pathlib import Path

import triton_python_backend_utils as pb_utils
from image_classifier.model_repository import parameters, pixels_dtype
from image_classifier.python_backend import (
    Batch,
    Instance,
    error_response,
    exit_stub,
    load_postprocess,
    split_responses,
    to_triton,
)
from image_classifier.stages import Preprocess


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])
        self.postprocess = load_postprocess(self.instance, args)
        repository = Path(args["model_repository"]).parent
        params = parameters(repository / "preprocess")  # resize, crop, max_image_pixels: preprocess's own
        self.preprocess = Preprocess(
            self.instance.device,
            pixels_dtype(repository),
            resize=int(params["resize"]),
            crop=int(params["crop"]),
            max_pixels=int(params["max_image_pixels"]),
        )

    async def execute(self, requests):
        groups = [
            [bytes(image) for image in pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)]
            for request in requests
        ]
        try:
            self.instance.bind()
            pixels = Batch.of(self.preprocess.batch(groups))  # a bad image fails its own request only
        except Exception as exc:  # a failure of the batch itself, not of one image
            return [error_response(exc) for _ in requests]
        results = await pixels.then(self.classify)
        return split_responses(results.data, results.sizes)

    async def classify(self, pixels):
        resnet = await self.instance.infer("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"], self.timeout_us)
        return self.postprocess.to_host(self.instance.to_torch(resnet["LOGITS"]))

    def finalize(self):
        exit_stub()

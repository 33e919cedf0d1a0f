"""The BLS entry point: preprocess -> resnet -> postprocess, GPU tensors handed on zero-copy with DLPack.

All requests of one execute() make one BLS call per stage: one preprocess batch, one ResNet batch. The top-k
runs here, with the postprocess stage's own code: it is microseconds of GPU work, and a BLS round trip costs about
a millisecond (set the parameter `postprocess` to "bls" to call the postprocess model instead). A request whose
images fail to decode gets its own error; the rest are served. Edit the routing here: this is the file to make
yours.
"""

import asyncio

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.python_backend import (
    Instance,
    error_response,
    exit_stub,
    is_input_error,
    load_postprocess,
    to_triton,
)

OUTPUTS = ["SCORES", "CLASS_IDS", "LABELS"]


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])
        self.postprocess = None
        if self.instance.parameters["postprocess"] == "in_process":
            self.postprocess = load_postprocess(self.instance, args)

    async def execute(self, requests):
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE") for request in requests]
        pixels, batch = await self.preprocess(images)
        good = [p for p in pixels if not isinstance(p, Exception)]
        if good:
            try:
                outputs = await self.classify(batch if batch is not None else torch.cat(good))
            except Exception as exc:
                pixels = [exc if not isinstance(p, Exception) else p for p in pixels]

        responses, start = [], 0
        for p in pixels:
            if isinstance(p, Exception):
                responses.append(error_response(p))
                continue
            end = start + p.shape[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(n, outputs[n][start:end]) for n in OUTPUTS]))
            start = end
        return responses

    async def preprocess(self, images):
        """(pixels or error per request, all pixels as one batch when every request succeeded).

        All requests go in one call. If an image is bad that call fails with an input error, and each request is
        sent again on its own, so that the error reaches only the request that holds the bad image.
        """
        joined = images[0]
        if len(images) > 1:
            joined = pb_utils.Tensor("IMAGE", np.concatenate([image.as_numpy() for image in images]))
        try:
            batch = await self.preprocess_one(joined)
            return list(batch.split([image.shape()[0] for image in images])), batch
        except Exception as exc:
            if len(images) == 1 or not is_input_error(exc):
                return [exc] * len(images), None  # not an image's fault (overload, timeout): no retry
        calls = (self.preprocess_one(image) for image in images)
        return await asyncio.gather(*calls, return_exceptions=True), None

    async def preprocess_one(self, images):
        result = await self.instance.infer("preprocess", [images], ["PIXELS"], self.timeout_us)
        return self.instance.to_torch(result["PIXELS"])

    async def classify(self, pixels):
        resnet = await self.instance.infer("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"], self.timeout_us)
        if self.postprocess is not None:
            return self.postprocess.to_host(self.instance.to_torch(resnet["LOGITS"]))
        # LOGITS goes on as the very tensor resnet returned: no copy, no conversion. The top-k results only go
        # back to the client over gRPC, so they come back in host memory (a few bytes per image; LABELS are
        # strings, which can neither live on the GPU nor travel through DLPack).
        result = await self.instance.infer("postprocess", [resnet["LOGITS"]], OUTPUTS, self.timeout_us, on_host=True)
        return {name: result[name].as_numpy() for name in OUTPUTS}

    def finalize(self):
        exit_stub()  # leave at once: python_backend.exit_stub says why

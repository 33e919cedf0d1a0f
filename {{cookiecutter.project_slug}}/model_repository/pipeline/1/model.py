"""The BLS entry point: preprocess -> resnet -> postprocess, GPU tensors handed on zero-copy with DLPack.

All requests of one execute() are decoded here as one batch, with the preprocess stage's own code, and make one
BLS call: one ResNet batch. The top-k runs here too, with the postprocess stage's code: it is microseconds of GPU
work, and a BLS round trip costs about a millisecond. Set the parameter `preprocess` or `postprocess` to "bls" to
call that model instead (config.pbtxt says when `preprocess: "bls"` is worth it). A request whose images fail to
decode gets its own error; the rest are served (`Batch` in python_backend.py keeps the requests apart). Edit the
routing here: this is the file to make yours.
"""

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.model_repository import OUTPUTS
from {{ cookiecutter.package_name }}.python_backend import (
    Batch,
    Instance,
    batch_then_alone,
    exit_stub,
    load_postprocess,
    load_preprocess,
    split_responses,
    to_triton,
)


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])
        self.postprocess = self.decoder = None
        if self.instance.parameters["postprocess"] == "in_process":
            self.postprocess = load_postprocess(self.instance, args)
        if self.instance.parameters["preprocess"] == "in_process":
            self.decoder = load_preprocess(self.instance, args)

    async def execute(self, requests):
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE") for request in requests]
        if self.decoder is not None:
            pixels = self.decode(images)
        else:
            pixels = await batch_then_alone(self.preprocess, images)  # one call; a bad image fails its own request
        results = await pixels.then(self.classify)  # resnet and the top-k, once for every request still served
        return split_responses(results.data, results.sizes)

    async def preprocess(self, images):
        result = await self.instance.infer("preprocess", [images], ["PIXELS"], self.timeout_us)
        return self.instance.to_torch(result["PIXELS"])

    def decode(self, images):
        """The preprocess stage in this process, on every request's images at once; a bad image fails its own
        request only. Strings cannot travel through DLPack: encoded images are read as numpy, on the CPU."""
        self.instance.bind()
        groups = [[bytes(image) for image in tensor.as_numpy().reshape(-1)] for tensor in images]
        try:
            return Batch.of(self.decoder.batch(groups))
        except Exception as exc:  # a failure of the batch itself, not of one image
            return Batch(None, [exc] * len(groups))

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

"""The BLS entry point: preprocess -> resnet -> postprocess, three Triton models called in order, GPU tensors
handed from one to the next zero-copy with DLPack.

All requests of one execute() make one batch: one BLS call to each model, in order. A request whose images fail
to decode gets its own error; the rest are served (`Batch` in batches.py keeps them apart). Before each later
stage a request its client cancelled answers CANCELLED, one past its deadline UNAVAILABLE. The calls block
(`request.exec()`, cheaper than awaited), and `Instance.serve` answers the requests if a called model's stub dies
under a call (python_backend.Guard). Edit the routing here: this is the file to make yours.

The parameters `preprocess` and `postprocess` (config.pbtxt) can run a stage's code in this process instead of
calling its model ("in_process"): faster at low concurrency, at a cost in GPU memory and in what separate models
give (docs/performance.md, "The fused pipeline").
"""

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.model_repository import OUTPUTS
from {{ cookiecutter.package_name }}.python_backend import (
    Instance,
    batch_then_alone,
    bytes_of,
    exit_stub,
    fused_postprocess,
    fused_preprocess,
    request_limits,
    split_responses,
    to_triton,
)


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])
        self.limits = request_limits(args)  # preprocess's caps on a request's bytes, checked before calling it
        if self.instance.parameters["preprocess"] == "in_process":  # fused: the same stage, without its BLS call
            self.preprocess = fused_preprocess(self.instance, args)
        if self.instance.parameters["postprocess"] == "in_process":
            self.postprocess = fused_postprocess(self.instance, args)

    def execute(self, requests):
        return self.instance.serve(self.classify, requests)

    def classify(self, requests):
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE") for request in requests]
        # one call; a bad image, or a request over a cap, fails its own request
        pixels = batch_then_alone(self.preprocess, images, check=lambda i: self.limits.check_bytes(bytes_of(i)))
        pixels = self.instance.unless_gone(pixels, before="resnet")  # cancelled or past its deadline: no more work
        logits = pixels.then(self.resnet)  # once for every request still served
        logits = self.instance.unless_gone(logits, before="postprocess")
        results = logits.then(self.postprocess)
        return split_responses(results.data, results.sizes)

    def preprocess(self, images):
        result = self.instance.infer("preprocess", [images], ["PIXELS"], self.timeout_us)
        return self.instance.to_torch(result["PIXELS"])

    def resnet(self, pixels):
        result = self.instance.infer("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"], self.timeout_us)
        return self.instance.to_torch(result["LOGITS"])

    def postprocess(self, logits):
        # The top-k results only go back to the client over gRPC, so they come back in host memory (a few bytes per
        # image; LABELS are strings, which can neither live on the GPU nor travel through DLPack).
        inputs = [to_triton("LOGITS", logits)]
        result = self.instance.infer("postprocess", inputs, OUTPUTS, self.timeout_us, on_host=True)
        return {name: result[name].as_numpy() for name in OUTPUTS}

    def finalize(self):
        exit_stub()  # leave at once: python_backend.exit_stub says why

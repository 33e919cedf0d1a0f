"""PROBE (not shipped): the pipeline with a plain `def execute` and synchronous BLS calls (request.exec()),
to measure what the async path (event-loop thread + run_in_executor per call) costs."""

import numpy as np
import triton_python_backend_utils as pb_utils

from image_classifier.python_backend import (
    Instance,
    StageError,
    error_response,
    exit_stub,
    load_postprocess,
    split_responses,
    to_triton,
)


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])
        self.postprocess = load_postprocess(self.instance, args)

    def call(self, model, inputs, outputs):
        request = pb_utils.InferenceRequest(
            model_name=model,
            inputs=inputs,
            requested_output_names=outputs,
            preferred_memory=self.instance.preferred_memory,
            timeout=self.timeout_us,
        )
        response = request.exec()
        if response.has_error():
            raise StageError(f"{model}: {response.error().message()}", response.error().code())
        return {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}

    def execute(self, requests):
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE") for request in requests]
        joined = images[0]
        if len(images) > 1:
            joined = pb_utils.Tensor("IMAGE", np.concatenate([t.as_numpy() for t in images]))
        sizes = [t.shape()[0] for t in images]
        try:
            pixels = self.instance.to_torch(self.call("preprocess", [joined], ["PIXELS"])["PIXELS"])
            logits = self.call("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"])["LOGITS"]
            return split_responses(self.postprocess.to_host(self.instance.to_torch(logits)), sizes)
        except Exception as exc:
            return [error_response(exc) for _ in requests]

    def finalize(self):
        exit_stub()

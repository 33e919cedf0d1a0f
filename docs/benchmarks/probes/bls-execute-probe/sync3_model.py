"""PROBE (issue 33): the three-model pipeline with a plain `def execute` and synchronous BLS calls (request.exec()),
preprocess -> resnet -> postprocess, to measure what the async path (the stub's event-loop thread, and an executor
thread and an asyncio wake-up per call) costs when the pipeline calls all three models. No per-request retry of a
bad image and no give-up on a dead stub: the shipped model.py has both."""

import numpy as np
import triton_python_backend_utils as pb_utils

from image_classifier.model_repository import OUTPUTS
from image_classifier.python_backend import Instance, StageError, error_response, exit_stub, split_responses, to_triton


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])

    def call(self, model, inputs, outputs, on_host=False):
        request = pb_utils.InferenceRequest(
            model_name=model,
            inputs=inputs,
            requested_output_names=outputs,
            preferred_memory=self.instance.host_memory if on_host else self.instance.preferred_memory,
            timeout=self.timeout_us,
        )
        response = request.exec()
        if response.has_error():
            raise StageError(f"{model}: {response.error().message()}", response.error().code())
        return {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}

    def execute(self, requests):
        self.instance.bind()
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE") for request in requests]
        joined = images[0]
        if len(images) > 1:
            joined = pb_utils.Tensor("IMAGE", np.concatenate([t.as_numpy() for t in images]))
        sizes = [t.shape()[0] for t in images]
        try:
            pixels = self.instance.to_torch(self.call("preprocess", [joined], ["PIXELS"])["PIXELS"])
            logits = self.instance.to_torch(self.call("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"])["LOGITS"])
            result = self.call("postprocess", [to_triton("LOGITS", logits)], OUTPUTS, on_host=True)
            return split_responses({name: result[name].as_numpy() for name in OUTPUTS}, sizes)
        except Exception as exc:
            return [error_response(exc) for _ in requests]

    def finalize(self):
        exit_stub()

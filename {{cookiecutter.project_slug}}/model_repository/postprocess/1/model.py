"""Logits -> top-k softmax scores, class ids and ImageNet labels."""

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.python_backend import Instance, to_triton
from {{ cookiecutter.package_name }}.stages import Postprocess


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        top_k = pb_utils.get_output_config_by_name(self.instance.config, "SCORES")["dims"][0]
        self.postprocess = Postprocess(top_k)

    def execute(self, requests):
        responses = []
        for request in requests:
            scores, class_ids = self.postprocess(self.instance.input(request, "LOGITS"))
            labels = pb_utils.Tensor("LABELS", self.postprocess.label(class_ids))  # strings: numpy, CPU
            responses.append(
                pb_utils.InferenceResponse([to_triton("SCORES", scores), to_triton("CLASS_IDS", class_ids), labels])
            )
        return responses

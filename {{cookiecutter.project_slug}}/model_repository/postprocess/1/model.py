"""Logits -> top-k softmax scores, class ids and labels (the file named by the `labels_file` parameter)."""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.python_backend import Instance, to_triton
from {{ cookiecutter.package_name }}.stages import Postprocess, read_labels


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        top_k = pb_utils.get_output_config_by_name(self.instance.config, "SCORES")["dims"][0]
        classes = int(pb_utils.get_input_config_by_name(self.instance.config, "LOGITS")["dims"][0])
        labels = read_labels(Path(args["model_repository"]) / self.instance.parameters["labels_file"])
        if not len(labels) == classes >= top_k:
            raise pb_utils.TritonModelException(
                f"{len(labels)} labels, {classes} LOGITS, top-{top_k}: labels.txt, the class count and top_k disagree;"
                " write them together with `{{ cookiecutter.project_slug }} weights import`"
            )
        self.postprocess = Postprocess(top_k, labels)

    def execute(self, requests):
        responses = []
        for request in requests:
            scores, class_ids = self.postprocess(self.instance.input(request, "LOGITS"))
            labels = pb_utils.Tensor("LABELS", self.postprocess.label(class_ids))  # strings: numpy, CPU
            responses.append(
                pb_utils.InferenceResponse([to_triton("SCORES", scores), to_triton("CLASS_IDS", class_ids), labels])
            )
        return responses

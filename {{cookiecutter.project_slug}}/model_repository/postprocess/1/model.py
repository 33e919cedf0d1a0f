"""Logits -> top-k softmax scores, class ids and labels (the file named by the `labels_file` parameter)."""

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.python_backend import Instance, exit_stub, join, load_postprocess, split_responses


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        classes = int(pb_utils.get_input_config_by_name(self.instance.config, "LOGITS")["dims"][0])
        self.postprocess = load_postprocess(self.instance, args, classes)

    def execute(self, requests):
        # One top-k on the GPU for every request of the batch, one copy of the results to the host.
        logits = [self.instance.input(request, "LOGITS") for request in requests]
        outputs = self.postprocess.to_host(join(logits))
        return split_responses(outputs, [part.shape[0] for part in logits])

    def finalize(self):
        exit_stub()  # leave at once: python_backend.exit_stub says why

"""Pixels -> logits with torchvision's ResNet; weights come from a file in this version directory."""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }} import compiled
from {{ cookiecutter.package_name }}.python_backend import Instance, error_response, exit_stub, join, split_responses
from {{ cookiecutter.package_name }}.stages import Classifier


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        params = self.instance.parameters
        weights = Path(args["model_repository"]) / args["model_version"] / params["weights_file"]
        if not weights.is_file():
            raise pb_utils.TritonModelException(
                f"missing weights {weights}: run `{{ cookiecutter.project_slug }} weights pretrained` "
                f"(downloads torchvision's), `{{ cookiecutter.project_slug }} weights random` (offline) "
                f"or `{{ cookiecutter.project_slug }} weights import YOUR.pt`"
            )
        classes = int(pb_utils.get_output_config_by_name(self.instance.config, "LOGITS")["dims"][0])
        dtype, max_batch_size = self.instance.dtype("PIXELS"), self.instance.config["max_batch_size"]
        # On a GPU: compiled from the cache `serve` filled for these weights (compiled.py), else eager, saying why
        model, how = None, "eager on the CPU"
        if self.instance.on_gpu:
            target = compiled.Target(params["variant"], weights, dtype, max_batch_size, classes, params["compile"])
            model, how = compiled.load(target, self.instance.device)
        stage = (params["variant"], weights, self.instance.device, dtype)
        options = dict(max_batch_size=max_batch_size, cuda_graphs=params["cuda_graphs"] == "true", num_classes=classes)
        try:
            self.classifier = Classifier(*stage, compiled=model, **options)
        except Exception as exc:
            if model is None:
                raise
            how = f"eager, the compiled model failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            self.classifier = Classifier(*stage, **options)
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: {how}; {self.classifier.load_report}")

    def execute(self, requests):
        # One forward pass for every request the dynamic batcher gathered.
        pixels = [self.instance.input(request, "PIXELS") for request in requests]
        try:
            logits = self.classifier(join(pixels))
        except Exception as exc:
            return [error_response(exc) for _ in requests]
        return split_responses({"LOGITS": logits}, [p.shape[0] for p in pixels])

    def finalize(self):
        exit_stub()  # leave at once: python_backend.exit_stub says why

"""JPEG/PNG bytes -> normalized pixels on this instance's device (nvJPEG on a GPU)."""

import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.python_backend import Instance, error_response, exit_stub, to_triton


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.preprocess = self.instance.preprocess()  # stages.Preprocess, as this model's config sets it up

    def execute(self, requests):
        # Strings cannot travel through DLPack: encoded images are read as numpy, on the CPU.
        groups = [
            [bytes(image) for image in pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)]
            for request in requests
        ]
        try:
            results = self.preprocess.batch(groups)
        except Exception as exc:  # a failure of the batch itself, not of one image
            return [error_response(exc) for _ in requests]
        return [
            error_response(pixels)
            if isinstance(pixels, Exception)
            else pb_utils.InferenceResponse([to_triton("PIXELS", pixels)])
            for pixels in results
        ]

    def finalize(self):
        exit_stub()  # leave at once: python_backend.exit_stub says why

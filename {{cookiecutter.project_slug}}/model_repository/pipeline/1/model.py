"""The BLS entry point: preprocess -> resnet -> postprocess, GPU tensors handed on zero-copy with DLPack.

All requests of one execute() become one ResNet batch. A request whose images fail to decode gets its
own error; the rest of the batch is served. Edit the routing here: this is the file to make yours.
"""

import asyncio

import torch
import triton_python_backend_utils as pb_utils

from {{ cookiecutter.package_name }}.python_backend import Instance, error_response, to_triton

OUTPUTS = ["SCORES", "CLASS_IDS", "LABELS"]


class TritonPythonModel:
    def initialize(self, args):
        self.instance = Instance(args)
        self.timeout_us = int(self.instance.parameters["bls_timeout_us"])

    async def execute(self, requests):
        # Each request is preprocessed on its own, so a bad image fails only its request;
        # the preprocess model's dynamic batcher merges these concurrent calls again.
        pixels = await asyncio.gather(*(self.preprocess(r) for r in requests), return_exceptions=True)
        good = [p for p in pixels if not isinstance(p, Exception)]
        if good:
            try:
                outputs = await self.classify(good[0] if len(good) == 1 else torch.cat(good))
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

    async def preprocess(self, request):
        image = pb_utils.get_input_tensor_by_name(request, "IMAGE")
        result = await self.instance.infer("preprocess", [image], ["PIXELS"], self.timeout_us)
        return self.instance.to_torch(result["PIXELS"])

    async def classify(self, pixels):
        resnet = await self.instance.infer("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"], self.timeout_us)
        # LOGITS goes on as the very tensor resnet returned: no copy, no conversion. The top-k results only go
        # back to the client over gRPC, so they come back in host memory (a few bytes per image; LABELS are
        # strings, which can neither live on the GPU nor travel through DLPack).
        result = await self.instance.infer("postprocess", [resnet["LOGITS"]], OUTPUTS, self.timeout_us, on_host=True)
        return {name: result[name].as_numpy() for name in OUTPUTS}

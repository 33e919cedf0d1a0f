"""PROBE (not shipped): the shipped pipeline (baked default, image_classifier) with each execute's phases timed,
to itemize where a BLS request's fixed cost goes. Per execute one JSON line is appended to
$TMPDIR/pipeline-phases/<pid>.jsonl: the wall time, the images and requests of the batch, and in ms
- read: the requests' IMAGE inputs read (as numpy, host);
- decode: preprocess, in process (`preprocess: "in_process"`, synchronized: its GPU work done) or the BLS call;
- resnet: the resnet BLS call, from the request built to the response's tensors in hand;
- topk: the in-process top-k with its copy to the host;
- respond: the responses built.
The sum against Triton's compute_infer for the pipeline is what the stub and the event loop cost around execute.
Install in a bake: gpu_run.sh's `probe docs/benchmarks/bls-execute-probe/phases_model.py` step."""

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils
from image_classifier.python_backend import (
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
        self.postprocess = load_postprocess(self.instance, args)
        self.decoder = None
        if self.instance.parameters["preprocess"] == "in_process":
            self.decoder = load_preprocess(self.instance, args)
        folder = Path(tempfile.gettempdir()) / "pipeline-phases"
        folder.mkdir(exist_ok=True)
        self.log = open(folder / f"{os.getpid()}.jsonl", "a", buffering=1)

    def sync(self):
        if self.instance.on_gpu:
            torch.cuda.synchronize(self.instance.device)

    async def execute(self, requests):
        t = [time.perf_counter()]
        images = [pb_utils.get_input_tensor_by_name(request, "IMAGE") for request in requests]
        groups = [[bytes(image) for image in tensor.as_numpy().reshape(-1)] for tensor in images]
        t.append(time.perf_counter())
        if self.decoder is not None:
            self.instance.bind()
            pixels = Batch.of(self.decoder.batch(groups))
            self.sync()
        else:
            pixels = await batch_then_alone(self.preprocess, images)
        t.append(time.perf_counter())
        logits = await pixels.then(self.resnet)
        t.append(time.perf_counter())
        results = await logits.then(self.topk)
        t.append(time.perf_counter())
        responses = split_responses(results.data, results.sizes)
        t.append(time.perf_counter())
        phases = dict(zip(("read", "decode", "resnet", "topk", "respond"), (1e3 * (b - a) for a, b in zip(t, t[1:]))))
        line = {"at": time.time(), "requests": len(requests), "images": sum(map(len, groups)), **phases}
        self.log.write(json.dumps(line) + "\n")
        return responses

    async def preprocess(self, images):
        result = await self.instance.infer("preprocess", [images], ["PIXELS"], self.timeout_us)
        return self.instance.to_torch(result["PIXELS"])

    async def resnet(self, pixels):
        result = await self.instance.infer("resnet", [to_triton("PIXELS", pixels)], ["LOGITS"], self.timeout_us)
        return self.instance.to_torch(result["LOGITS"])

    async def topk(self, logits):
        return self.postprocess.to_host(logits)

    def finalize(self):
        self.log.close()
        exit_stub()

"""PROBE (not shipped): the shipped pipeline, unchanged, with each execute's phases timed, to itemize where a BLS
request's fixed cost goes. It loads the bake's own pipeline code from `shipped_model.py` beside it (gpu_run.sh's
`probe` step keeps the shipped model.py there) and wraps three of its calls. Per execute one JSON line goes to
$TMPDIR/pipeline-phases/<pid>.jsonl: the wall time, the images and requests of the batch, and in ms
- decode: the preprocess stage, in process (`preprocess: "in_process"`, synchronized: its GPU work done) or the BLS
  call to the preprocess model;
- resnet: the resnet BLS call, from the request built to the response's tensors in hand;
- topk: the in-process top-k with its copy to the host;
- other: the rest of execute (inputs read, batching, the event loop, the responses built).
Against Triton's compute_infer for the pipeline, what is left is the stub's own cost around execute.
Install in a bake: gpu_run.sh's `probe docs/benchmarks/probes/bls-execute-probe/phases_model.py` step."""

import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

_spec = importlib.util.spec_from_file_location("shipped_pipeline", Path(__file__).with_name("shipped_model.py"))
shipped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shipped)


class TritonPythonModel(shipped.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self.times = {}
        folder = Path(tempfile.gettempdir()) / "pipeline-phases"
        folder.mkdir(exist_ok=True)
        self.log = (folder / f"{os.getpid()}.jsonl").open("a", buffering=1)
        infer = self.instance.infer

        async def timed_infer(model_name, *args, **kwargs):
            started = time.perf_counter()
            try:
                return await infer(model_name, *args, **kwargs)
            finally:  # a call to preprocess is the decode
                self.add("decode" if model_name == "preprocess" else model_name, started)

        self.instance.infer = timed_infer
        if self.postprocess is not None:
            to_host = self.postprocess.to_host

            def timed_to_host(logits):
                started = time.perf_counter()
                try:
                    return to_host(logits)
                finally:
                    self.add("topk", started)

            self.postprocess.to_host = timed_to_host

    def add(self, phase, started):
        self.times[phase] = self.times.get(phase, 0.0) + 1e3 * (time.perf_counter() - started)

    def decode(self, images):
        started = time.perf_counter()
        try:
            pixels = super().decode(images)
            if self.instance.on_gpu:
                torch.cuda.synchronize(self.instance.device)
            return pixels
        finally:
            self.add("decode", started)

    async def execute(self, requests):
        self.times, started = {}, time.perf_counter()
        responses = await super().execute(requests)
        total = 1e3 * (time.perf_counter() - started)
        images = sum(pb_utils.get_input_tensor_by_name(request, "IMAGE").shape()[0] for request in requests)
        line = {"at": time.time(), "requests": len(requests), "images": images, **self.times}
        line["other"] = total - sum(self.times.values())
        self.log.write(json.dumps(line) + "\n")
        return responses

    def finalize(self):
        self.log.close()
        super().finalize()

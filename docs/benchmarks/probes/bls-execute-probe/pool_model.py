"""PROBE (not shipped): the shipped pipeline with its BLS call waited for without asyncio's cross-thread wake-up.
`def execute` runs the shipped async execute on an event loop of its own on the stub's main thread (as
own_loop_model.py), and each BLS call (`request.exec()`) goes to a thread pool and is waited for there with a
blocking `Future.result(timeout)` that looks for a recorded death of the called model's stub every POLL_S and gives
up with the shipped call's error, or at the shipped deadline. The wait blocks the loop: calls that the shipped
code overlaps (recipe 3's versions, the per-request retry after a bad image with `preprocess: "bls"`) run one
after another here; with the default routing the pipeline makes one call per execute (resnet), so nothing
overlaps. On the CPU of the template's machine, with a trivial called model (`docs/benchmarks/probes/cpu-handoff/`), one
request's p50 read 1.46-1.51 ms this way against 1.76-1.84 ms with `async_exec()` and 1.37-1.38 ms with a bare
`request.exec()`, which cannot be given up. Everything else in execute is the shipped code.
On the H200 (a67d997, ../e2e-h200-a67d997-pool-probe.*) it did not help: one image 6.95 ms, BLS / ensemble
0.86, 0.83, 0.83 at 1/4/16 x 8 against the shipped execute's 0.95, 0.96, 0.98 just before it. Not shipped.
Install in a bake: gpu_run.sh's `probe docs/benchmarks/probes/bls-execute-probe/pool_model.py` step."""

import asyncio
import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as NotYet
from pathlib import Path

import triton_python_backend_utils as pb_utils
from image_classifier import stub_deaths
from image_classifier.python_backend import INVALID_INPUT, StageError
from image_classifier.shm import DEV_SHM_ADVICE, SHM_GROWTH_FAILED

_spec = importlib.util.spec_from_file_location("shipped_pipeline", Path(__file__).with_name("shipped_model.py"))
shipped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shipped)


def wait(model: str, call, deadline_s: float | None):
    """`call`'s result; StageError (UNAVAILABLE) once a death of a stub of `model` is recorded after the call began,
    or after `deadline_s` (stub_deaths.answer, with a blocking wait instead of asyncio's)."""
    started = time.time()
    while True:
        waited = time.time() - started
        step = stub_deaths.POLL_S if deadline_s is None else min(stub_deaths.POLL_S, max(deadline_s - waited, 0))
        try:
            return call.result(timeout=step)
        except NotYet:
            pass
        waited = time.time() - started
        if stub_deaths.died_since(model, started):
            message = f"{model}: a stub of {model} died while this call waited; the watchdog reloads it"
        elif deadline_s is not None and waited >= deadline_s:
            message = f"{model}: no answer in {deadline_s:.0f} s (a dead stub? `serve`'s watchdog reloads it)"
        else:
            continue
        call.cancel()
        raise StageError(message, pb_utils.TritonError.UNAVAILABLE)


class TritonPythonModel(shipped.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(16, thread_name_prefix="bls")  # a call given up keeps its thread
        instance, pool = self.instance, self.pool

        async def infer(model_name, inputs, outputs, timeout_us=0, on_host=False, model_version=-1):
            """python_backend.Instance.infer, its call waited for by `wait`."""
            instance.bind()
            request = pb_utils.InferenceRequest(
                model_name=model_name,
                model_version=model_version,
                inputs=inputs,
                requested_output_names=outputs,
                preferred_memory=instance.host_memory if on_host else instance.preferred_memory,
                timeout=timeout_us,
            )
            deadline_s = timeout_us / 1e6 + 5 if timeout_us else None
            response = wait(model_name, pool.submit(request.exec), deadline_s)
            if response.has_error():
                message = response.error().message()
                code = pb_utils.TritonError.INVALID_ARG if INVALID_INPUT in message else response.error().code()
                if SHM_GROWTH_FAILED in message:
                    message = f"{DEV_SHM_ADVICE}. {message}"
                raise StageError(f"{model_name}: {message}", code)
            return {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}

        instance.infer = infer

    def execute(self, requests):
        return self.loop.run_until_complete(super().execute(requests))

"""PROBE (not shipped): the shipped pipeline, unchanged, with its `async def execute` driven by an event loop of its
own on the stub's main thread (`def execute` -> `loop.run_until_complete`) instead of the stub's event-loop thread.
The same code and the same BLS calls through `async_exec()`, so a call still gives up when a death of the called
model's stub is recorded (stub_deaths) and still has its deadline; what goes is one thread hand-over each way per
execute (the stub's main thread to its event-loop thread and back). The BLS call's own hand-over to an executor
thread stays: it is what lets a call be given up. On the CPU of the template's machine (2 cores),
with a trivial called model (`docs/benchmarks/probes/cpu-handoff/`), that saved 0.05-0.1 ms of one request's p50 (1.72-1.84 ms
with the stub's loop); the call's own wake-up through asyncio is the larger cost (pool_model.py).
Install in a bake: gpu_run.sh's `probe docs/benchmarks/probes/bls-execute-probe/own_loop_model.py` step."""

import asyncio
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("shipped_pipeline", Path(__file__).with_name("shipped_model.py"))
shipped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shipped)


class TritonPythonModel(shipped.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self.loop = asyncio.new_event_loop()

    def execute(self, requests):
        return self.loop.run_until_complete(super().execute(requests))

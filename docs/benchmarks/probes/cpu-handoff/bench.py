"""What a BLS call's thread hand-overs cost in a Python-backend stub, on the CPU: a trivial `sink` model, and four
drivers that each make one BLS call to it per request, the way the pipeline could:
- drv_async: `async def execute`, `await asyncio.wait([request.async_exec()])` (the shipped pipeline's way,
  stub_deaths.answer): the stub's main thread hands the execute to its event-loop thread, the call goes to an
  executor thread, and back;
- drv_ownloop: `def execute` running the same coroutine on an event loop of its own on the main thread
  (bls-execute-probe/own_loop_model.py): the executor hand-over stays, the event-loop thread's goes;
- drv_pool: `def execute`, `pool.submit(request.exec).result(timeout)`: a blocking wait that could still give up;
- drv_sync: `def execute`, `request.exec()`: no hand-over, and no way to give a call up.
One client, one request in flight, 800 requests a model a round, 3 rounds interleaved; p50 and p90 in ms.

    python docs/benchmarks/probes/cpu-handoff/bench.py    # from a venv with a baked project installed (its server.py)
"""

import os
import platform
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from image_classifier.server import ServerSettings, TritonServer

MODELS = ["sink", "drv_async", "drv_ownloop", "drv_pool", "drv_sync"]


def main() -> None:
    here = Path(__file__).resolve().parent
    settings = ServerSettings.on_free_ports(here / "repo")
    results: dict[str, list[tuple[float, float]]] = {}
    with TritonServer(settings) as server:
        server.wait_ready(300)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        x = grpcclient.InferInput("X", [4], "FP32")
        x.set_data_from_numpy(np.ones(4, np.float32))
        for _ in range(3):
            for model in MODELS:
                for _ in range(50):
                    client.infer(model, [x])
                times = []
                for _ in range(800):
                    started = time.perf_counter()
                    client.infer(model, [x])
                    times.append((time.perf_counter() - started) * 1e3)
                times.sort()
                results.setdefault(model, []).append((times[len(times) // 2], times[int(len(times) * 0.9)]))
    lines = [
        f"CPU: {platform.machine()}, {len(os.sched_getaffinity(0))} cores; tritonserver 2.51.0 (nvidia-pytriton 0.7.0)",
        "",
        "| model | p50, p90 (ms), round 1 | round 2 | round 3 |",
        "|---|---|---|---|",
    ]
    for model, rounds in results.items():
        lines.append(f"| {model} | " + " | ".join(f"{a:.3f}, {b:.3f}" for a, b in rounds) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    (here / "results.md").write_text(text)


if __name__ == "__main__":
    main()

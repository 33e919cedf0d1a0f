"""What holds a Python-backend stub's GPU memory: one process per variant, measured by NVML (nvidia-smi), without
and with a CUDA MPS daemon (the project's mps.start, as `serve` runs it).

    python docs/benchmarks/probes/stub-memory-probe.py OUT.json      # on the GPU machine, the bake installed

Each variant is a child process that sets itself up as a stub of that kind would, then waits; the parent reads its
used memory from `nvidia-smi --query-compute-apps` once it settles. Variants:
- driver: cuInit + the primary context, no torch (what any stub that touches a GPU tensor holds at least);
- torch: torch's CUDA initialized (what the pipeline stub does: torch.cuda.set_device + a tiny tensor);
- torch-stack-N: the same, then the per-thread stack limit lowered to N bytes (cuCtxSetLimit), which sizes the
  context's local-memory reservation (threads per SM x SMs x stack);
- torch-eager: CUDA_MODULE_LOADING=EAGER (every kernel of torch loaded at context creation);
- postprocess: torch + the top-k stage warmed at batch 1 and 128;
- resnet / resnet-empty-cache: the Classifier (resnet50 fp16, batch 128, CUDA graphs), then empty_cache();
- preprocess / preprocess-budget-16M: Preprocess fp16 with own_gpu_memory(128) at the decode budget given (the
  default, 24 M pixels, since 3bcf9b2; probe-*.json files before it ran `preprocess` at 64 M);
- preprocess-photos: `preprocess`, then 40 batches of 16 photo-size JPEGs (500x375 to 6000x4000, the decode budget),
  timed; its "ready" line adds torch's reserved memory, before and after, and the ms a batch. PROBE_STAGES=FILE
  takes the stages from that file (another commit's stages.py) instead of the installed package's;
- preprocess-photos-mb-N: the same at max batch N (its cap and warm-up), the photos N at a time (at most 16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VARIANTS = [
    "driver",
    "torch",
    "torch-stack-0",
    "torch-stack-256",
    "torch-eager",
    "postprocess",
    "postprocess-stack-256",
    "resnet",
    "resnet-empty-cache",
    "resnet-empty-cache-stack-256",
    "preprocess",
    "preprocess-budget-16M",
    "preprocess-budget-16M-stack-256",
    "d2d-stack-0",
    "kernel-stack-0",
]


def child(variant: str) -> None:
    import ctypes

    if variant == "driver":
        cuda = ctypes.CDLL("libcuda.so.1")
        ctx, dev = ctypes.c_void_p(), ctypes.c_int()
        assert cuda.cuInit(0) == 0
        assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
        assert cuda.cuCtxSetCurrent(ctx) == 0
        ptr = ctypes.c_uint64()
        assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
    else:
        import torch

        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")
        if variant.startswith("postprocess"):
            from image_classifier.stages import Postprocess

            Postprocess(5).warm(torch.device("cuda", 0), 1000, 128)
        if variant.startswith("resnet"):
            from image_classifier.stages import Classifier

            Classifier("resnet50", None, "cuda:0", torch.float16, max_batch_size=128)
            if "empty-cache" in variant:
                torch.cuda.empty_cache()
        if variant.startswith("preprocess"):
            stages = _stages()
            budget = 16_000_000 if "budget-16M" in variant else stages.DECODE_BUDGET_PIXELS
            pre = stages.Preprocess("cuda:0", torch.float16, decode_budget_pixels=budget)
            batch = int(variant.rsplit("-mb-", 1)[1]) if "-mb-" in variant else 128
            pre.own_gpu_memory(batch)
            if variant.startswith("preprocess-photos"):
                print("ready", json.dumps(_photos(pre, min(16, batch))), flush=True)
                time.sleep(600)
        if "-stack-" in variant:
            size = int(variant.rsplit("-", 1)[1])
            cuda = ctypes.CDLL("libcuda.so.1")
            assert cuda.cuCtxSetLimit(0, ctypes.c_size_t(size)) == 0  # CU_LIMIT_STACK_SIZE
            torch.cuda.synchronize()
        if variant.startswith(("d2d", "kernel")):  # after the trim: what a D2D copy (a BLS input's) or a kernel adds
            a = torch.empty(38 << 20, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            b.copy_(a) if variant.startswith("d2d") else a.add_(1)
            torch.cuda.synchronize()
            del a, b
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
    print("ready", flush=True)
    time.sleep(600)


def _stages():
    if not os.environ.get("PROBE_STAGES"):
        from image_classifier import stages

        return stages
    import importlib.util

    spec = importlib.util.spec_from_file_location("probe_stages", os.environ["PROBE_STAGES"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _photos(pre, batch: int = 16) -> dict:
    """40 batches of `batch` JPEGs drawn from photo sizes up to the decode budget: torch's memory and the ms a batch."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    def jpeg(w, h):
        y, x = np.mgrid[0:h, 0:w] / max(w, h)
        rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x) * np.cos(4 * y)], axis=-1) * 255
        out = io.BytesIO()
        Image.fromarray(rgb.astype(np.uint8)).save(out, format="JPEG", quality=90)
        return out.getvalue()

    sizes = [(500, 375), (1920, 1080), (4032, 3024), (4000, 3000), (6000, 4000)]
    pool = [jpeg(w, h) for w, h in sizes]
    rng = np.random.default_rng(0)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_reserved(0)
    torch.cuda.reset_peak_memory_stats(0)
    start = time.perf_counter()
    for _ in range(40):
        pre([pool[i] for i in rng.integers(0, len(pool), batch)])
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000 / 40
    mib = 1 << 20
    return {
        "reserved_loaded_mib": loaded // mib,
        "reserved_after_mib": torch.cuda.memory_reserved(0) // mib,
        "peak_reserved_mib": torch.cuda.max_memory_reserved(0) // mib,
        "peak_allocated_mib": torch.cuda.max_memory_allocated(0) // mib,
        "ms_a_batch": round(ms, 1),
    }


def used_mib() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    return {int(p): int(m) for p, m in (line.split(",") for line in out.splitlines() if line.strip())}


def measure(env: dict, variants: list[str]) -> dict[str, int]:
    results = {}
    for variant in variants:  # one at a time: MPS clients and NVML rows stay apart
        e = dict(env)
        if variant == "torch-eager":
            e["CUDA_MODULE_LOADING"] = "EAGER"
        p = subprocess.Popen([sys.executable, __file__, "--child", variant], env=e, stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline().strip()
        time.sleep(1.5)
        results[variant] = used_mib().get(p.pid, -1) if line.startswith("ready") else -2
        if line.startswith("ready "):  # preprocess-photos: what it measured itself
            results[variant] = {"nvml_mib": results[variant], **json.loads(line[6:])}
        p.kill()
        p.wait()
        print(variant, results[variant], "MiB", flush=True)
    return results


def main() -> None:
    out, only = sys.argv[1], sys.argv[2:]  # probe OUT.json [VARIANT ...]: those variants alone, under MPS
    from image_classifier import mps

    report = {
        "gpu": subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    }
    if not only:
        report["no_mps"] = measure(dict(os.environ), VARIANTS[:4])
    daemon, status = mps.start([0])
    print("MPS:", status, flush=True)
    try:
        env = dict(os.environ)
        if daemon is not None:
            env.update(daemon.env)
        report["mps"] = measure(env, only or VARIANTS)
    finally:
        if daemon is not None:
            daemon.stop()
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__" and sys.argv[1:2] != ["--server"]:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()


def server_memory(counts: dict[str, int], seconds: float = 20) -> dict:
    """The real server (the bake's own flags, MPS) at `counts`: GPU MiB per process by model, after load and after
    `seconds` of closed-loop load at 16 images x 64 in flight."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import numpy as np
    import tritonclient.grpc as grpcclient

    from benchmarks._common import bench_repository, bench_server, sample_jpegs
    from image_classifier.health import stub_processes
    from image_classifier.model_repository import set_instance_counts

    work = Path(tempfile.mkdtemp())
    repo = bench_repository(work)
    set_instance_counts(repo, counts)
    server = bench_server(repo, work / "log.txt")

    def snapshot() -> dict:
        used, models = used_mib(), stub_processes(server.process.pid)
        per: dict[str, list[int]] = {}
        for pid, model in models.items():
            per.setdefault(model or "?", []).append(used.get(pid, 0))
        per["tritonserver"] = [used.get(server.process.pid, 0)]
        return {m: {"each": sorted(v), "sum": sum(v)} for m, v in per.items()} | {
            "total": sum(sum(v) for v in per.values())
        }

    try:
        loaded = snapshot()
        images = np.array([[j] for j in sample_jpegs(16)], dtype=object)
        stop = time.monotonic() + seconds
        done = [0]

        def loop(_):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            inp = grpcclient.InferInput("IMAGE", list(images.shape), "BYTES")
            inp.set_data_from_numpy(images)
            while time.monotonic() < stop:
                client.infer("pipeline", [inp])
                done[0] += 16

        with ThreadPoolExecutor(64) as pool:
            list(pool.map(loop, range(64)))
        loaded_after = snapshot()
        return {
            "counts": counts,
            "after_load": loaded,
            "after_load_and_traffic": loaded_after,
            "img_s": round(done[0] / seconds),
        }
    finally:
        server.stop()


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--server":
    os.chdir(sys.argv[3])  # the baked project's root: benchmarks/ imports from there
    sys.path.insert(0, sys.argv[3])
    result = {
        c: server_memory(dict(zip(("pipeline", "preprocess", "resnet", "postprocess"), map(int, c.split("/")))))
        for c in sys.argv[4:]
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))

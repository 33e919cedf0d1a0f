"""The ResNet stage's ceiling outside Triton: eager, CUDA graphs and the model compiled by torch.compile from the
cache `compile` fills (compiled.py), one process each, on the bake's weights. Run from a baked project's root on a GPU machine:

    python ../../docs/benchmarks/probes/compile-probe.py OUT [STEP ...]

STEP: eager-fp16, graph-fp16, compile-default-fp16, compiled-default-fp16, ... (default: all, in order);
model-default-fp32 (or -fp16, -bf16): the model alone, torch.compile'd at batch 128 only and captured as a CUDA
graph, its scores against fp32 eager's (the precision a user picks: what each costs and how far it strays);
model-dynamic-fp16: one graph for every batch size but 1, each size's first call timed (run it twice: cold, warm).
Each bench runs the stage's own Classifier (padding to buckets, the copy in and the clone out) at batch 128 and at
batch 1, writes its logits on a fixed batch, and compares them with eager's of the same precision.
Writes OUT/compile-probe.json (one row per step) as it goes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = [
    "eager-fp16",
    "graph-fp16",
    "compile-default-fp16",
    "compiled-default-fp16",
    "graph-fp32",
    "graph-bf16",
]
WEIGHTS = Path("model_repository/resnet/1/weights.pt")


def gpu_mib(pid: int) -> int:
    rows = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True,
    ).stdout.splitlines()
    return sum(int(used) for p, used in (r.split(", ") for r in rows if r) if int(p) == pid)


def bench(out: Path, mode: str, dtype_name: str) -> dict:
    import torch

    from image_classifier import compiled
    from image_classifier.model_repository import torch_dtype
    from image_classifier.stages import Classifier

    dtype = torch_dtype(dtype_name.upper())  # the project's one type table: fp16 is Triton's FP16
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    started = time.monotonic()
    runner = None
    if mode.startswith("compiled-"):
        target = compiled.Target("resnet50", WEIGHTS, dtype, 128, 1000, mode.removeprefix("compiled-"))
        runner, why = compiled.load(target, device)
        if runner is None:
            return {"error": why}
    loaded = time.monotonic() - started
    clf = Classifier("resnet50", WEIGHTS, device, dtype, 128, cuda_graphs=mode != "eager", compiled=runner)
    row = {"load_s": round(loaded, 2), "classifier_s": round(time.monotonic() - started, 2), "report": clf.load_report}
    x = torch.randn(128, 3, 224, 224, device=device, dtype=dtype)
    for batch, iters in ((128, 40), (32, 80)):
        for _ in range(5):
            clf(x[:batch])
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            clf(x[:batch])
        torch.cuda.synchronize()
        row[f"images_per_s_b{batch}"] = round(batch * iters / (time.perf_counter() - t))
    times = []
    for _ in range(200):
        t = time.perf_counter()
        clf(x[:1])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    row["b1_p50_ms"] = round(sorted(times)[100] * 1e3, 3)
    g = torch.Generator(device="cpu").manual_seed(0)
    fixed = torch.randn(8, 3, 224, 224, generator=g).to(device, dtype)
    logits = clf(fixed).float().cpu()
    torch.save(logits, out / f"logits-{mode}-{dtype_name}.pt")
    ref = out / f"logits-eager-{dtype_name}.pt"
    if ref.is_file() and mode != "eager":
        eager = torch.load(ref)
        row["max_abs_logit_diff"] = float((logits - eager).abs().max())
        row["max_softmax_diff"] = float((logits.softmax(1) - eager.softmax(1)).abs().max())
        row["top1_equal"] = bool((logits.argmax(1) == eager.argmax(1)).all())
    row["gpu_mib"] = gpu_mib(os.getpid())
    row["torch_reserved_mib"] = torch.cuda.memory_reserved() >> 20
    return row


def model_bench(out: Path, mode: str, dtype_name: str) -> dict:
    """One precision, compiled as the stage compiles it, batch 128 only: images/s and its scores against fp32."""
    import tempfile

    import torch

    from image_classifier import compiled
    from image_classifier.model_repository import torch_dtype

    dtype = torch_dtype(dtype_name.upper())  # the project's one type table: fp16 is Triton's FP16
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dynamic = mode == "dynamic"  # one graph for batch 1 and one for every other size (a symbolic batch)
    target = compiled.Target("resnet50", WEIGHTS, dtype, 128, 1000, "default")
    started = time.monotonic()
    cache = out / f"cache-{mode}-{dtype_name}" if dynamic else Path(tempfile.mkdtemp(prefix=f"probe-{dtype_name}-"))
    row = {"warm": dynamic and cache.is_dir() and any(cache.rglob("*"))}  # before anything compiles into it
    model = compiled.compile_model(target, device, cache)
    if dynamic:  # the batch dimension only (on the H100: 2 graphs, batch 1 and the rest; on a CPU also 16 up)
        model = torch.compile(model._orig_mod, mode="default")
    with torch.inference_mode():
        x = torch.randn(128, 3, 224, 224, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
        for size in (1, 2, 4, 8, 16, 32, 64, 128) if dynamic else (128, 128, 128):
            batch = torch.randn(size, 3, 224, 224, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
            if dynamic:
                torch._dynamo.maybe_mark_dynamic(batch, 0)
            t = time.monotonic()
            model(batch)
            torch.cuda.synchronize()
            row[f"first_b{size}_s"] = round(time.monotonic() - t, 2)
        if dynamic:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        compile_s = time.monotonic() - started
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        row |= {"compile_s": round(compile_s, 1), "images_per_s_b128": round(128 * 50 / (time.perf_counter() - t))}
        g = torch.Generator(device="cpu").manual_seed(0)
        fixed = torch.randn(128, 3, 224, 224, generator=g)
        x.copy_(fixed.to(device, dtype))
        graph.replay()
        logits = y.float().cpu()
    ref = out / "logits-model-fp32-eager.pt"
    if not ref.is_file():
        from image_classifier.resnet import build_resnet

        eager = build_resnet("resnet50", WEIGHTS, 1000).to(device).eval()
        with torch.inference_mode():
            torch.save(eager(fixed.to(device)).float().cpu(), ref)
    want = torch.load(ref)
    row["max_softmax_diff_vs_fp32_eager"] = float((logits.softmax(1) - want.softmax(1)).abs().max())
    row["top1_equal_vs_fp32_eager"] = float((logits.argmax(1) == want.argmax(1)).float().mean())
    row["max_abs_logit_diff_vs_fp32_eager"] = float((logits - want).abs().max())
    row["gpu_mib"] = gpu_mib(os.getpid())
    from torch._dynamo.utils import counters

    row["graphs"] = counters["stats"].get("unique_graphs")
    row["fxgraph_cache"] = {k: v for k, v in counters["inductor"].items() if "fxgraph" in k}
    return row


def main() -> int:
    if sys.argv[1] == "--bench":
        out, mode, dtype_name = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
        run = model_bench if mode.startswith("model-") else bench
        print("ROW " + json.dumps(run(out, mode.removeprefix("model-"), dtype_name)), flush=True)
        return 0
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    previous = out / "compile-probe.json"  # a second run into the same OUT adds its rows
    rows = json.loads(previous.read_text()) if previous.is_file() else []
    rows += [{"step": "machine", "torch": torch.__version__, "cuda": torch.version.cuda,
             "gpu": torch.cuda.get_device_name(0), "CUDA_HOME": os.environ.get("CUDA_HOME", "")}]
    for step in sys.argv[2:] or DEFAULT:
        kind, _, rest = step.partition("-")
        mode, _, dtype_name = rest.rpartition("-")
        started = time.monotonic()
        if kind == "compile":  # as `serve` does it, for the bake's precision, in the mode asked for
            from image_classifier import compiled, model_repository

            model_repository.set_parameter("model_repository", "resnet", "compile", mode)
            done = subprocess.run([sys.executable, "-m", "image_classifier.compiled", "--repository=model_repository"],
                                  capture_output=True, text=True, timeout=int(os.environ.get("COMPILE_LIMIT_S", 420)))
            row = {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}
            readies = sorted(compiled.cache_root().glob("*/ready.json"), key=lambda p: p.stat().st_mtime)
            if done.returncode == 0 and readies:
                files = [f for f in readies[-1].parent.rglob("*") if f.is_file()]
                row |= {"cache_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
                        "fields": json.loads(readies[-1].read_text())}
        else:
            mode = f"{kind}-{mode}" if kind in ("compiled", "model") else kind
            done = subprocess.run([sys.executable, __file__, "--bench", str(out), mode, dtype_name],
                                  capture_output=True, text=True, timeout=300)
            lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(lines[-1][4:]) if lines else {"rc": done.returncode, "tail": done.stderr[-1500:]}
        row = {"step": step, "wall_s": round(time.monotonic() - started, 1)} | row
        print(json.dumps(row), flush=True)
        rows.append(row)
        (out / "compile-probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

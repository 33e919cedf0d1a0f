"""Which step of the AOTInductor path crashes (the compiled package's check ended with -11 on an H100, torch 2.11):
compile one package (default mode, batch 1-128), then load and run it in a fresh process per variant of the load
(plain, run_single_threaded, device_index, under CUDA-graph capture); beside it, torch.compile with a persistent
Inductor cache, cold then warm. Run from a baked project's root on the GPU machine:

    python ../../docs/benchmarks/probes/aoti-crash-probe.py OUT
"""

import faulthandler
import json
import os
import subprocess
import sys
import time

faulthandler.enable()
OUT = sys.argv[1]
PKG = "/tmp/diag/pkg.pt2"
WEIGHTS = "model_repository/resnet/1/weights.pt"


def model():
    import torch
    from image_classifier.compiled import _Logits
    from image_classifier.stages import build_resnet
    from torch.fx.experimental.optimization import fuse

    m = fuse(build_resnet("resnet50", WEIGHTS, 1000))
    return _Logits(m).cuda().half().to(memory_format=torch.channels_last).eval()


def pixels(b):
    import torch

    return torch.randn(b, 3, 224, 224, device="cuda").half().contiguous(memory_format=torch.channels_last)


def rate(fn, b=128, n=30):
    import torch

    x = pixels(b)
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()
    return round(b * n / (time.perf_counter() - t))


def graphed(fn, b=128):
    import torch

    x = pixels(b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        fn(x)
    return lambda _: g.replay()


def step(name):
    import torch

    if name == "compile":
        from torch._inductor import aoti_compile_and_package

        os.makedirs("/tmp/diag", exist_ok=True)
        m, t = model(), time.time()
        with torch.no_grad():
            ep = torch.export.export(
                m, (pixels(128),), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=128)},)
            )
        aoti_compile_and_package(ep, package_path=PKG)
        return {"compile_s": round(time.time() - t, 1)}
    if name.startswith("tc"):
        m, t = model(), time.time()
        c = torch.compile(m, mode="max-autotune-no-cudagraphs" if "autotune" in name else "default", dynamic=False)
        with torch.no_grad():
            c(pixels(128))
        first = round(time.time() - t, 1)
        with torch.no_grad():
            eager, comp = rate(m), rate(c)
            g = rate(graphed(c))
        return {"first_call_s": first, "eager_b128": eager, "compiled_b128": comp, "compiled_graph_b128": g}
    from torch._inductor import aoti_load_package

    kw = {}
    if "single" in name:
        kw["run_single_threaded"] = True
    if "devidx" in name:
        kw["device_index"] = 0
    print(name, "loading", kw, flush=True)
    r = aoti_load_package(PKG, **kw)
    print(name, "loaded", flush=True)
    got = {}
    with torch.no_grad():
        for b in (1, 128):
            y = r(pixels(b))
            torch.cuda.synchronize()
            print(name, "ran", b, tuple(y.shape), flush=True)
        got["b128"] = rate(r)
        if "graph" in name:
            got["graph_b128"] = rate(graphed(r))
    return got


if len(sys.argv) > 2:
    print("RESULT", json.dumps({"step": sys.argv[2], **step(sys.argv[2])}), flush=True)
    sys.exit(0)


def run(name, env=None):
    t = time.time()
    p = subprocess.run(
        [sys.executable, "-X", "faulthandler", __file__, OUT, name],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=400,
    )
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    row = json.loads(lines[-1][7:]) if lines else {"step": name}
    row.update(rc=p.returncode, wall_s=round(time.time() - t, 1))
    if p.returncode:
        row["stdout_tail"] = p.stdout[-600:]
        row["stderr_tail"] = p.stderr[-1500:]
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "aoti-crash-probe.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


from concurrent.futures import ThreadPoolExecutor

ind = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/diag/inductor"}
with ThreadPoolExecutor(2) as pool:
    tc = pool.submit(run, "tc-default-cold", ind)
    run("compile")
    tc.result()
for name in ("plain", "single", "devidx", "plain-graph", "single-devidx-graph"):
    run(name)
run("tc-default-warm", ind)

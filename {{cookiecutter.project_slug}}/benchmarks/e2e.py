"""Benchmark 2: end-to-end throughput and p50/p99 latency over gRPC (JPEG in, top-k out), BLS vs ensemble.

    python -m benchmarks.e2e [--precision fp32 fp16] [--concurrency 1 2 4 8 16 32 64] [--images-per-request 1 16]
                             [--instances preprocess=6 resnet=2] [--mps on off] [--points 1x1 16x64]
                             [--stages bls fused] [--compile max-autotune off] [--rounds 2]

Starts the project's tritonserver (its own flags; random weights unless model_repository has weights.pt; CUDA MPS
on a GPU as `serve` does, `--mps off` without it, `--mps on off` both, one server after the other; `--stages`
sets the pipeline's `preprocess` and `postprocess` parameters: `bls` calls the three models, `fused` runs both
stages in the pipeline's own process, `bls fused` compares both the same way),
and for each images per request and concurrency (requests in flight, closed loop) measures each entry point's
client-side latency and images/s for --seconds, the entry points one after the other at each point, so that they
are compared under the same conditions; `--rounds` repeats the whole sweep, the order of the entry points reversed
in every other round (a drift of the machine then weighs on both alike). With both `pipeline` and `ensemble` among
--models it prints the BLS / ensemble images/s ratio at each point, per round and their median, and writes them
into e2e.json (`ratios`) and above e2e.md's table. The client is several processes of gRPC threads, so that
Python is not the limit; `client_cpu` in the JSON says how busy they were.
Writes e2e.json, e2e.md and e2e.png.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import (
    RESULTS,
    GpuSampler,
    bench_repository,
    bench_server,
    environment,
    instance_counts,
    model_statistics,
    sample_jpegs,
    set_precision,
    statistics_delta,
    write,
)


def worker(url, model, images, threads, start_at, warmup_s, seconds, queue):
    """Closed loop on `threads` gRPC clients; latencies of requests sent inside the window."""
    import threading

    import tritonclient.grpc as grpcclient

    batch = np.array([[image] for image in images], dtype=object)
    window = (start_at + warmup_s, start_at + warmup_s + seconds)
    latencies, errors, lock = [], [], threading.Lock()

    def loop():
        client = grpcclient.InferenceServerClient(url)
        inputs = [grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")]
        inputs[0].set_data_from_numpy(batch)
        mine, failed = [], []
        while time.time() < start_at:
            time.sleep(0.001)
        while True:
            sent = time.time()
            if sent >= window[1]:
                break
            try:
                client.infer(model, inputs)
            except Exception as exc:  # counted and reported, never hidden
                failed.append(str(exc)[:200])
                continue
            done = time.time()
            if sent >= window[0]:
                mine.append((done - sent) * 1e3)
        client.close()
        with lock:
            latencies.extend(mine)
            errors.extend(failed)

    cpu0 = time.process_time()
    pool = [threading.Thread(target=loop) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    queue.put((latencies, errors, time.process_time() - cpu0))


def run_point(url, model, images, concurrency, seconds, warmup_s=1.0, max_procs=12, headers=None) -> dict:
    """One closed-loop point; with the admin `headers`, also Triton's per-model statistics over the point, and
    the GPU's utilization (NVML) while it ran."""
    ctx = mp.get_context("spawn")
    procs = min(concurrency, max_procs)
    split = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    queue = ctx.Queue()
    start_at = time.time() + 3.0  # time for the spawned processes to import and connect
    ps = [ctx.Process(target=worker, args=(url, model, images, n, start_at, warmup_s, seconds, queue)) for n in split]
    for p in ps:
        p.start()
    before = model_statistics(url, headers) if headers is not None else {}
    latencies, errors, cpu = [], [], 0.0
    with GpuSampler() as gpu:
        for _ in ps:
            lat, err, c = queue.get()
            latencies += lat
            errors += err
            cpu += c
    stages = statistics_delta(before, model_statistics(url, headers)) if headers is not None else {}
    for p in ps:
        p.join()
    lat = np.array(latencies or [float("nan")])
    if errors:
        print(f"{model}: {len(errors)} failed requests, first: {errors[0]}")
    return {
        "errors": len(errors),
        "requests": len(latencies),
        "img_s": len(latencies) * len(images) / seconds,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "client_cpu": cpu / (seconds + warmup_s + 3.0),
        **gpu.summary(),
        "stages": stages,
    }


def perf_analyzer_point(url, headers, model, image, batch, concurrency, seconds, workdir: Path) -> dict:
    """The same point measured by Triton's perf_analyzer (the same JPEG `batch` times per request)."""
    import base64
    import csv
    import json
    import subprocess

    import tritonclient.utils

    # one batch-1 element: the JPEG as a serialized (length-prefixed) BYTES tensor, base64 in perf_analyzer's JSON
    raw = tritonclient.utils.serialize_byte_tensor(np.array([image], dtype=object)).item()
    data = workdir / "pa_input.json"
    data.write_text(json.dumps({"data": [{"IMAGE": {"b64": base64.b64encode(raw).decode()}}]}))
    report = workdir / f"pa_{model}_{batch}_{concurrency}.csv"
    argv = ["perf_analyzer", "-m", model, "-u", url, "-i", "grpc", "-b", str(batch), "--input-data", str(data)]
    argv += ["--shape", "IMAGE:1", "--concurrency-range", str(concurrency), "-f", str(report)]
    argv += ["--measurement-interval", str(int(seconds * 1000)), "--stability-percentage", "50", "--max-trials", "4"]
    argv += [arg for key, value in headers.items() for arg in ("-H", f"{key}:{value}")]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"perf_analyzer did not run: {exc}"}
    if run.returncode != 0 or not report.is_file():
        return {"error": (run.stdout + run.stderr)[-600:]}
    (row,) = list(csv.DictReader(report.open()))
    return {
        "img_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1e3,
        "p99_ms": float(row["p99 latency"]) / 1e3,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", default=[None], help="rewrite PIXELS to this (default: as baked)")
    parser.add_argument("--models", nargs="+", default=["pipeline", "ensemble"])
    parser.add_argument("--images-per-request", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--points",
        nargs="+",
        default=[],
        metavar="NxC",
        help="measure only these (images per request)x(concurrency) pairs, e.g. 1x1 16x64, instead of the grid",
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=1, help="measure every point this many times (see above)")
    parser.add_argument(
        "--instances",
        nargs="+",
        default=[],
        metavar="MODEL=COUNT",
        help="instance counts to try instead of the configs' (e.g. preprocess=4 pipeline=2)",
    )
    parser.add_argument(
        "--perf-analyzer",
        type=int,
        nargs="*",
        metavar="CONCURRENCY",
        help="cross-check points with perf_analyzer: those of these concurrencies (none listed: every point)",
    )
    parser.add_argument(
        "--mps",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="CUDA MPS for the server (on: the default of serve, where there is a GPU); `on off` compares both",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=list(STAGE_SETTINGS),
        default=[None],
        help="the pipeline's `preprocess` and `postprocess` parameters (default: as baked): bls calls the three "
        "models, fused runs both stages in the pipeline; `bls fused` compares both",
    )
    parser.add_argument(
        "--compile",
        nargs="+",
        choices=["max-autotune", "default", "off"],
        default=[None],
        help="the resnet model's `compile` parameter (default: as baked); `max-autotune off` compares compiled "
        "and eager, one server after the other",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    jpegs = sample_jpegs(64)
    rows: list[dict] = []

    def save(row: dict) -> dict:  # written after each point: a run cut short keeps what it measured
        rows.append(row)
        results = e2e_results(args, rows)
        sizes = sorted({r["images_per_request"] for r in rows})
        write("e2e", results, rows, COLUMNS, plot_throughput(rows, sizes), args.out)
        return results

    servers = [(p, m, q, c) for p in args.precision for m in args.mps for q in args.stages for c in args.compile]
    for server, (precision, mps, stages, mode) in enumerate(servers, 1):
        measure_server(
            args, precision, mps, jpegs, stages, lambda row, server=server: save(dict(row, server=server)), mode
        )
    results = e2e_results(args, rows)
    if results["ratios"]:
        print("\nBLS / ensemble images/s:\n" + ratio_table(results["ratios"]))
    return results


def e2e_results(args, rows: list[dict]) -> dict:
    points = ratios(rows)
    return {
        "title": "End to end over gRPC (JPEG in, top-k out): BLS pipeline vs ensemble",
        "environment": environment(),
        "ratios": points,
        "notes": [
            "Closed loop: `concurrency` requests in flight, each `images_per_request` 500x375 JPEGs; client-side "
            f"latency; {args.seconds:g} s per point after 1 s warm-up; client_cpu = client CPU cores busy; "
            "gpu_util_pct = NVML utilization, mean over the point; pa_* = perf_analyzer on the same point "
            "(the same JPEG repeated); each row's `stages` in the JSON holds Triton's per-model statistics "
            "(requests, mean batch, queue / compute_input / compute_infer / compute_output ms per request); "
            "mps = the server ran under CUDA MPS (its own daemon, as `serve`); instances = the Python-backend "
            "instance counts per GPU the row was served with; pipeline_preprocess, pipeline_postprocess = the "
            "pipeline's parameters of those names (bls: a BLS call to that model; in_process: the pipeline runs the "
            "stage itself, fused); resnet_compile = the resnet model's compile parameter (off: eager); "
            "gpu_mem_mib = the most GPU memory in use during the point (NVML); round = which "
            "pass of --rounds (the entry points measured one after the other at each point, their order reversed "
            "every other round).",
            *(["\n" + ratio_table(points)] if points else []),
        ],
        "rows": rows,
    }


COLUMNS = [
    "precision",
    "mps",
    "model",
    "round",
    "images_per_request",
    "concurrency",
    "img_s",
    "p50_ms",
    "p99_ms",
    "errors",
    "client_cpu",
    "gpu_util_pct",
    "gpu_mem_mib",
    "pa_img_s",
    "pa_vs_own",
]


STAGE_SETTINGS = {"bls": "bls", "fused": "in_process"}  # --stages: the pipeline's preprocess and postprocess


def measure_server(
    args, precision: str | None, mps: str, jpegs: list[bytes], stages: str | None, save=None, compile_mode=None
) -> list[dict]:
    """One server (this precision, instance counts, MPS setting, pipeline stage parameters and resnet compile mode):
    a row for every point of every entry point, each handed to `save` as soon as it is measured."""
    from {{ cookiecutter.package_name }}.model_repository import parameters, set_instance_counts, set_parameter

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(tmp)
        if precision:
            set_precision(repo, precision)
        instances = {m: int(c) for m, c in (item.split("=") for item in args.instances)}
        set_instance_counts(repo, instances)
        for stage in ("preprocess", "postprocess") if stages else ():
            set_parameter(repo, "pipeline", stage, STAGE_SETTINGS[stages])
        if compile_mode:
            set_parameter(repo, "resnet", "compile", compile_mode)
        compile_mode = parameters(repo / "resnet")["compile"]
        preprocess, postprocess = (parameters(repo / "pipeline")[stage] for stage in ("preprocess", "postprocess"))
        server = bench_server(repo, Path(tmp) / "tritonserver.log", mps=mps == "on")
        mps_on = server.mps is not None  # what ran: "on" asks for MPS, a machine without it runs without
        label = (precision or "as baked") + "".join(f" {m}x{c}" for m, c in instances.items())
        label += " MPS" if mps_on else " no MPS"
        fused = [stage for stage, value in (("preprocess", preprocess), ("postprocess", postprocess)) if value != "bls"]
        label += " fused" if len(fused) == 2 else "".join(f" {stage} fused" for stage in fused)
        label += f" resnet {compile_mode}"
        try:
            pairs = [tuple(map(int, p.split("x"))) for p in args.points] or [
                (n, c) for n in args.images_per_request for c in args.concurrency
            ]
            models = [model for model in args.models if (repo / model).is_dir()]
            points = [
                (model, n, c, r)
                for r in range(1, args.rounds + 1)
                for n, c in pairs
                for model in (models if r % 2 else models[::-1])
            ]
            for model, n, c, r in points:
                point = measure_point(args, server, model, jpegs, n, c, Path(tmp))
                row = {
                    "precision": label,
                    "mps": mps_on,
                    "mps_status": server.mps_status,
                    "model": model,
                    "round": r,
                    "images_per_request": n,
                    "concurrency": c,
                    **point,
                    "instances": instance_counts(repo),
                    "pipeline_preprocess": preprocess,
                    "pipeline_postprocess": postprocess,
                    "resnet_compile": compile_mode,
                }
                rows.append(row)
                print_point(label, model, n, c, point)
                if save is not None:
                    save(row)
        finally:
            server.stop()
    return rows


def measure_point(args, server, model: str, jpegs: list[bytes], n: int, c: int, workdir: Path) -> dict:
    """Our own closed loop at one point, and perf_analyzer's figures beside it where asked for."""
    headers = server.settings.admin_headers
    point = run_point(server.grpc_url, model, jpegs[:n], c, args.seconds, headers=headers)
    if args.perf_analyzer is not None and (not args.perf_analyzer or c in args.perf_analyzer):
        pa = perf_analyzer_point(server.grpc_url, headers, model, jpegs[0], n, c, args.seconds, workdir)
        point["perf_analyzer"] = pa
        if "img_s" in pa:
            point["pa_img_s"], point["pa_p50_ms"] = pa["img_s"], pa["p50_ms"]
            point["pa_vs_own"] = pa["img_s"] / max(point["img_s"], 1e-9)
        else:
            print(f"perf_analyzer failed: {pa['error']}")
    return point


def ratios(rows: list[dict]) -> list[dict]:
    """BLS (`pipeline`) / `ensemble` images/s at every point of every server where both were measured: per round
    (None for a round where either failed a request or answered none) and the median of the others."""
    by_point: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("server", 1), row["precision"], row["images_per_request"], row["concurrency"])
        by_point.setdefault(key, {}).setdefault(row.get("round", 1), {})[row["model"]] = row
    out = []
    for (_, label, n, c), rounds in by_point.items():
        both = {r: m for r, m in sorted(rounds.items()) if "pipeline" in m and "ensemble" in m}
        if not both:
            continue
        per_round = [
            m["pipeline"]["img_s"] / m["ensemble"]["img_s"]
            if all(m[k]["img_s"] > 0 and not m[k]["errors"] for k in ("pipeline", "ensemble"))
            else None
            for m in both.values()
        ]
        valid = [x for x in per_round if x is not None]
        out.append(
            {
                "server": label,
                "images_per_request": n,
                "concurrency": c,
                "rounds": list(both),
                "bls_vs_ensemble": per_round,
                "median": float(np.median(valid)) if valid else None,
            }
        )
    return out


def ratio_table(points: list[dict]) -> str:
    if not points:
        return ""

    def fmt(x):
        return "n/a" if x is None else f"{x:.2f}"

    lines = ["| server | images/request | concurrency | BLS / ensemble per round | median |", "|---|---|---|---|---|"]
    for p in points:
        rounds = ", ".join(fmt(x) for x in p["bls_vs_ensemble"])
        lines.append(
            f"| {p['server']} | {p['images_per_request']} | {p['concurrency']} | {rounds} | {fmt(p['median'])} |"
        )
    return "\n".join(lines)


def print_point(label: str, model: str, n: int, c: int, point: dict) -> None:
    print(
        f"{label} {model:9s} n={n:3d} c={c:3d}: {point['img_s']:8,.0f} img/s  "
        f"p50 {point['p50_ms']:7.2f} ms  p99 {point['p99_ms']:7.2f} ms  "
        f"errors {point['errors']}  client cpu {point['client_cpu']:.1f}  "
        f"gpu {point.get('gpu_util_pct', float('nan')):.0f}%"
        + (f"  perf_analyzer {point['pa_img_s']:,.0f} img/s" if "pa_img_s" in point else "")
    )
    for stage, st in point["stages"].items():
        print(
            f"    {stage:12s} batch {st['mean_batch']:6.1f}  "
            + "  ".join(f"{k[:-3]} {v:6.2f}" for k, v in st.items() if k.endswith("_ms"))
        )


def plot_throughput(rows: list[dict], images_per_request: list[int]):
    """plot(ax) for _common.write: images/s over concurrency, a line per entry point, server and request size."""

    rounds = max((r.get("round", 1) for r in rows), default=1)
    median = f" (median of {rounds} rounds)" if rounds > 1 else ""

    def plot(ax):
        for model, color in (("pipeline", "tab:green"), ("ensemble", "tab:purple")):
            for server in dict.fromkeys(r.get("server", 1) for r in rows):
                mine = [r for r in rows if r.get("server", 1) == server and r["model"] == model]
                for n, style in zip(images_per_request, ("-", "--", ":", "-.")):
                    sel = [r for r in mine if r["images_per_request"] == n]
                    if sel:  # the median over rounds at each concurrency
                        xs = sorted({r["concurrency"] for r in sel})
                        ys = [float(np.median([r["img_s"] for r in sel if r["concurrency"] == x])) for x in xs]
                        ax.plot(
                            xs,
                            ys,
                            style,
                            marker="o",
                            color=color,
                            alpha=1.0 if sel[0]["mps"] else 0.5,
                            label=f"{model} {sel[0]['precision']} {n} img/req{median}",
                        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("images/s")
        ax.legend(fontsize=7)

    return plot


if __name__ == "__main__":
    main()

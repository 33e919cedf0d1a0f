"""Benchmark: the same requests over gRPC, system shared memory and CUDA shared memory (same-host clients).

    python -m benchmarks.shm [--images-per-request 1 16 128] [--concurrency 1 4] [--seconds 3]

Starts the project's tritonserver (its own flags; random weights unless model_repository has weights.pt) and, for
each transport and images per request, runs `concurrency` closed-loop clients (threads, each its own
ImageClassifier and regions) for --seconds:
- grpc, system: 500x375 JPEGs to `pipeline`, inside the gRPC message or through a /dev/shm region;
- grpc-pixels, system-pixels, cuda: the same images already preprocessed (as a client that decodes its own
  frames would hold them) to `classify_pixels`, inside the gRPC message, through /dev/shm, or through a CUDA IPC
  region from a torch CUDA tensor (needs a GPU here; skipped without one). Preprocessing is not timed.
Writes shm.json, shm.md and shm.png.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ._common import RESULTS, bench_repository, bench_server, environment, sample_jpegs, write

TRANSPORTS = ["grpc", "system", "grpc-pixels", "system-pixels", "cuda"]


def run_point(url, admin_key, transport, jpegs, pixels, concurrency, seconds, warmup_s=1.0) -> dict:
    from {{ cookiecutter.package_name }}.client import ImageClassifier

    shared_memory = {"system": "system", "system-pixels": "system", "cuda": "cuda"}.get(transport)
    clients = [ImageClassifier(url, shared_memory=shared_memory, admin_key=admin_key) for _ in range(concurrency)]
    call = (lambda c: c.classify(jpegs)) if transport in ("grpc", "system") else (lambda c: c.classify_pixels(pixels))
    for client in clients:
        call(client)  # regions made, shapes seen
    start_at = time.monotonic() + 0.2
    window = (start_at + warmup_s, start_at + warmup_s + seconds)
    latencies, errors, lock = [], [], threading.Lock()

    def loop(client):
        mine, failed = [], []
        while time.monotonic() < start_at:
            time.sleep(0.001)
        while (sent := time.monotonic()) < window[1]:
            try:
                call(client)
            except Exception as exc:  # counted and reported, never hidden
                failed.append(str(exc)[:200])
                continue
            if sent >= window[0]:
                mine.append((time.monotonic() - sent) * 1e3)
        with lock:
            latencies.extend(mine)
            errors.extend(failed)

    threads = [threading.Thread(target=loop, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for client in clients:
        client.close()
    if errors:
        print(f"{transport}: {len(errors)} failed requests, first: {errors[0]}")
    lat = np.array(latencies or [float("nan")])
    return {
        "errors": len(errors),
        "requests": len(latencies),
        "img_s": len(latencies) * len(jpegs) / seconds,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


def preprocessed(repository: Path, jpegs: list[bytes], device: str):
    """The pixels the server's preprocess model would make, here on `device`."""
    import torch

    from {{ cookiecutter.package_name }}.model_repository import parameters, pixels_dtype
    from {{ cookiecutter.package_name }}.stages import Preprocess

    preprocess = Preprocess.from_parameters(
        torch.device(device), pixels_dtype(repository), parameters(repository / "preprocess")
    )
    (pixels,) = preprocess.batch([jpegs])
    return pixels


def main(argv=None) -> dict:
    import torch

    from {{ cookiecutter.package_name }}.model_repository import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=TRANSPORTS, choices=TRANSPORTS)
    parser.add_argument("--images-per-request", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    transports = [t for t in args.transports if t != "cuda" or torch.cuda.is_available()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(tmp)
        max_batch = load_config(repo / "classify_pixels").max_batch_size
        sizes = sorted({min(n, max_batch) for n in args.images_per_request})
        jpegs = sample_jpegs(max(sizes))
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        all_pixels = preprocessed(repo, jpegs, device)
        server = bench_server(repo, Path(tmp) / "tritonserver.log")
        try:
            for n in sizes:
                for transport in transports:
                    pixels = all_pixels[:n] if transport == "cuda" else all_pixels[:n].cpu()
                    for c in args.concurrency:
                        point = run_point(
                            server.grpc_url, server.settings.admin_key, transport, jpegs[:n], pixels, c, args.seconds
                        )
                        rows.append({"transport": transport, "images_per_request": n, "concurrency": c, **point})
                        print(
                            f"{transport:13s} n={n:3d} c={c:2d}: {point['img_s']:8,.0f} img/s  "
                            f"p50 {point['p50_ms']:7.2f} ms  p99 {point['p99_ms']:7.2f} ms  errors {point['errors']}"
                        )
        finally:
            server.stop()

    results = {
        "title": "Same-host transports: gRPC vs system shared memory vs CUDA shared memory",
        "environment": environment(),
        "notes": [
            "Closed loop, `concurrency` client threads in one process, each its own client and regions; client-side "
            f"latency; {args.seconds:g} s per point after 1 s warm-up. grpc/system: 500x375 JPEGs to `pipeline`; "
            "*-pixels/cuda: the same images preprocessed beforehand (not timed) to `classify_pixels`."
        ],
        "rows": rows,
    }
    columns = ["transport", "images_per_request", "concurrency", "img_s", "p50_ms", "p99_ms", "errors"]
    write("shm", results, rows, columns, plot_transports(rows, transports, max(args.concurrency)), args.out)
    return results


def plot_transports(rows: list[dict], transports: list[str], concurrency: int):
    """plot(ax) for _common.write: images/s over images per request, a line per transport, at `concurrency`."""

    def plot(ax):
        for transport in transports:
            sel = [r for r in rows if r["transport"] == transport and r["concurrency"] == concurrency]
            ax.plot([r["images_per_request"] for r in sel], [r["img_s"] for r in sel], marker="o", label=transport)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"images per request (concurrency {concurrency})")
        ax.set_ylabel("images/s")
        ax.legend(fontsize=8)

    return plot


if __name__ == "__main__":
    main()

"""Benchmark 1: the cost of one hop inside Triton, DLPack vs as_numpy() + torch.from_numpy().cuda().

    python -m benchmarks.hop [--batches 1 2 4 ... 256] [--out benchmarks/results]

Serves benchmarks/hop_models (a driver stage that BLS-calls a sink stage, both KIND_GPU) and times the whole
synchronous BLS call that hands a [B,3,224,224] GPU tensor from the driver to the sink, FP32 and FP16:
- dlpack: pb_utils.Tensor.from_dlpack in the driver, from_dlpack(to_dlpack()) in the sink. Between the two stub
  processes the tensor travels through Triton's CUDA memory pool (a device-to-device copy into the pool plus
  CUDA IPC), never through the host: that is included, not hidden;
- numpy: x.cpu().numpy() in the driver, torch.from_numpy(as_numpy()).cuda() in the sink (GPU -> host -> shm -> GPU).
Writes hop.json, hop.md and hop.png.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from ._common import PROJECT, RESULTS, bench_server, environment, write

DTYPES = {"fp32": 0, "fp16": 1}
MODES = {"dlpack": 0, "numpy": 1}


def measure(client, batch: int, dtype: str, mode: str, iterations: int) -> list[float]:
    import tritonclient.grpc as grpcclient

    config = np.array([batch, DTYPES[dtype], MODES[mode], iterations], dtype=np.int64)
    inputs = [grpcclient.InferInput("CONFIG", [4], "INT64")]
    inputs[0].set_data_from_numpy(config)
    return client.infer("hop_driver", inputs, client_timeout=600).as_numpy("MS").tolist()


def main(argv=None) -> dict:
    import tritonclient.grpc as grpcclient

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument(
        "--iterations", type=int, default=100, help="DLPack hops per point (numpy: a tenth, at least 5)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    largest = max(args.batches) * 3 * 224 * 224 * 4
    pool = max(256 << 20, 4 * largest)
    with tempfile.TemporaryDirectory() as tmp:
        server = bench_server(PROJECT / "benchmarks" / "hop_models", Path(tmp) / "tritonserver.log", pool)
        try:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            rows = measure_hops(client, args.batches, args.iterations)
            client.close()
        finally:
            server.stop()

    results = {
        "title": "One BLS hop of a [B,3,224,224] GPU tensor inside Triton: DLPack vs as_numpy()",
        "environment": environment(),
        "cuda_memory_pool_bytes": pool,
        "notes": [
            "Median wall time of one synchronous BLS call from a GPU stage to the next (server and receiving stub "
            "included), measured in the sending stub. DLPack: GPU tensor through Triton's CUDA memory pool "
            "(device-to-device copy + CUDA IPC). numpy: x.cpu().numpy() -> shared memory -> torch.from_numpy().cuda().",
        ],
        "rows": rows,
    }
    columns = ["dtype", "batch", "MB", "dlpack_ms", "dlpack_p90_ms", "numpy_ms", "numpy_p90_ms", "speedup"]
    write("hop", results, rows, columns, plot_hops(rows), args.out)
    return results


def measure_hops(client, batches: list[int], iterations: int) -> list[dict]:
    """A row per precision and batch: median and p90 ms of a DLPack hop and of a numpy hop."""
    for dtype in DTYPES:
        for mode in MODES:
            measure(client, 8, dtype, mode, 5)  # warm up: CUDA contexts, pool, shm growth
    rows = []
    for dtype in DTYPES:
        for batch in batches:
            row = {
                "batch": batch,
                "dtype": dtype,
                "MB": batch * 3 * 224 * 224 * (4 if dtype == "fp32" else 2) / 1e6,
            }
            for mode in MODES:
                n = iterations if mode == "dlpack" else max(5, iterations // 10)
                measure(client, batch, dtype, mode, 3)
                times = measure(client, batch, dtype, mode, n)
                row[f"{mode}_ms"] = statistics.median(times)
                row[f"{mode}_p90_ms"] = float(np.percentile(times, 90))
            row["speedup"] = row["numpy_ms"] / row["dlpack_ms"]
            rows.append(row)
            print(
                f"{dtype} B={batch:4d}: dlpack {row['dlpack_ms']:.3f} ms, "
                f"numpy {row['numpy_ms']:.2f} ms, {row['speedup']:.0f}x"
            )
    return rows


def plot_hops(rows: list[dict]):
    """plot(ax) for _common.write: ms per hop over the batch, DLPack and numpy, a line per precision."""

    def plot(ax):
        for dtype, style in (("fp32", "-"), ("fp16", "--")):
            sel = [r for r in rows if r["dtype"] == dtype]
            for mode, color in (("dlpack", "tab:green"), ("numpy", "tab:red")):
                ax.plot(
                    [r["batch"] for r in sel],
                    [r[f"{mode}_ms"] for r in sel],
                    style,
                    color=color,
                    marker="o",
                    label=f"{mode} {dtype}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B of [B,3,224,224]")
        ax.set_ylabel("one hop, median ms")
        ax.legend()

    return plot


if __name__ == "__main__":
    main()

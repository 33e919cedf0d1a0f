"""Benchmark 3: the same stages in-process in PyTorch, no Triton, same GPU, batch and precision: the ceiling.

    python -m benchmarks.inprocess [--precision fp32 fp16] [--batches 1 8 32 128] [--out benchmarks/results]

Times Preprocess (GPU JPEG decode + resize/crop + normalize), Classifier and Postprocess from
src/<package>/stages.py, alone and chained, on 500x375 JPEGs. Writes inprocess.json, .md and .png.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ._common import PROJECT, RESULTS, environment, sample_jpegs, write


def timed(fn, budget_s: float = 1.5, min_runs: int = 5) -> float:
    """Median seconds of fn() (synchronized), after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times, spent = [], 0.0
    while len(times) < min_runs or spent < budget_s:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if len(times) >= 200:
            break
    return statistics.median(times)


def stage_times(ref, jpegs: list[bytes]) -> dict[str, float]:
    """Median seconds per batch of each stage alone and of the three chained."""
    pixels = ref.preprocess(jpegs)
    logits = ref.classifier(pixels)
    return {
        "preprocess": timed(lambda: ref.preprocess(jpegs)),
        "classifier": timed(lambda: ref.classifier(pixels)),
        "postprocess": timed(lambda: ref.postprocess(logits)),
        "pipeline": timed(lambda: ref(jpegs)),
    }


def main(argv=None) -> dict:
    import torch

    from {{ cookiecutter.package_name }}.model_repository import resnet_weights
    from {{ cookiecutter.package_name }}.stages import Reference
    from {{ cookiecutter.package_name }}.weights import write_random

    precisions = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "fp16"], choices=list(precisions))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    variant, weights = resnet_weights(PROJECT / "model_repository")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if not weights.is_file():
            weights = write_random(variant, Path(tmp) / "weights.pt")
        images = sample_jpegs(max(args.batches))
        for precision in args.precision:
            ref = Reference(variant, weights, 5, device="cuda:0", dtype=precisions[precision])
            for batch in args.batches:
                jpegs = images[:batch]
                t = stage_times(ref, jpegs)
                row = {"precision": precision, "batch": batch, "pipeline_ms": t["pipeline"] * 1e3}
                row.update({f"{k}_img_s": batch / v for k, v in t.items()})
                rows.append(row)
                print(f"{precision} B={batch:4d}: " + ", ".join(f"{k} {batch / v:,.0f} img/s" for k, v in t.items()))
            torch.cuda.empty_cache()

    results = {
        "title": f"In-process ceiling: the same stages in PyTorch, no Triton ({variant})",
        "environment": environment(),
        "notes": [
            "Images/s of each stage alone and of the three chained, median of synchronized runs; "
            "500x375 JPEGs (about 55 KB) decoded on the GPU (nvJPEG)."
        ],
        "rows": rows,
    }
    columns = [
        "precision",
        "batch",
        "preprocess_img_s",
        "classifier_img_s",
        "postprocess_img_s",
        "pipeline_img_s",
        "pipeline_ms",
    ]
    write("inprocess", results, rows, columns, plot_stages(rows), args.out)
    return results


def plot_stages(rows: list[dict]):
    """plot(ax) for _common.write: images/s over the batch, a line per stage and precision."""

    def plot(ax):
        for precision, style in (("fp32", "-"), ("fp16", "--"), ("bf16", ":")):
            sel = [r for r in rows if r["precision"] == precision]
            for stage, color in (("preprocess", "tab:blue"), ("classifier", "tab:orange"), ("pipeline", "tab:green")):
                if sel:
                    ax.plot(
                        [r["batch"] for r in sel],
                        [r[f"{stage}_img_s"] for r in sel],
                        style,
                        marker="o",
                        color=color,
                        label=f"{stage} {precision}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("images/s")
        ax.legend()

    return plot


if __name__ == "__main__":
    main()

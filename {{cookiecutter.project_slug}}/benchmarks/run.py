"""All three benchmarks, then the Triton-to-in-process ratio: `python -m benchmarks.run [--quick]`.

Writes hop, e2e, inprocess and summary (.json, .md, .png) to benchmarks/results (or --out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import e2e, hop, inprocess
from ._common import RESULTS, environment, write


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points, shorter runs (a smoke test)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "fp16"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--skip", nargs="*", default=[], choices=["hop", "e2e", "inprocess"])
    args = parser.parse_args(argv)
    out = ["--out", str(args.out)]
    args.out.mkdir(parents=True, exist_ok=True)
    quick_hop = ["--batches", "1", "128", "--iterations", "20"] if args.quick else []
    quick_e2e = ["--concurrency", "1", "8", "--images-per-request", "1", "16", "--seconds", "2"] if args.quick else []
    quick_inp = ["--batches", "1", "128"] if args.quick else []
    if "hop" not in args.skip:
        hop.main(quick_hop + out)
    if "inprocess" not in args.skip:
        inprocess.main(["--precision", *args.precision] + quick_inp + out)
    if "e2e" not in args.skip:
        e2e.main(["--precision", *args.precision] + quick_e2e + out)
    return summarize(args.out)


def summarize(out: Path) -> dict:
    """Best end-to-end images/s per entry point and precision over the in-process pipeline at the max batch."""
    e2e_rows = json.loads((out / "e2e.json").read_text())["rows"]
    inp_rows = json.loads((out / "inprocess.json").read_text())["rows"]
    rows = []
    for precision in dict.fromkeys(r["precision"] for r in e2e_rows):
        ceiling = max((r for r in inp_rows if r["precision"] == precision), key=lambda r: r["batch"], default=None)
        for model in dict.fromkeys(r["model"] for r in e2e_rows):
            sel = [r for r in e2e_rows if r["precision"] == precision and r["model"] == model]
            best = max(sel, key=lambda r: r["img_s"])
            one = [r for r in sel if r["images_per_request"] == 1 and r["concurrency"] == 1]
            row = {
                "precision": precision,
                "model": model,
                "best_img_s": best["img_s"],
                "at": f"{best['images_per_request']} img/req x {best['concurrency']}",
                "batch1_p50_ms": one[0]["p50_ms"] if one else None,
            }
            if ceiling:
                row["inprocess_img_s"] = ceiling["pipeline_img_s"]
                row["inprocess_batch"] = ceiling["batch"]
                row["ratio"] = best["img_s"] / ceiling["pipeline_img_s"]
            rows.append(row)
    results = {
        "title": "Triton end to end vs the same stages in-process",
        "environment": environment(),
        "rows": rows,
        "notes": ["ratio = best end-to-end images/s over in-process pipeline images/s at the largest batch."],
    }
    columns = ["precision", "model", "best_img_s", "at", "batch1_p50_ms", "inprocess_img_s", "inprocess_batch", "ratio"]

    def plot(ax):
        labels = [f"{r['model']}\n{r['precision']}" for r in rows]
        ax.bar([i - 0.2 for i in range(len(rows))], [r["best_img_s"] for r in rows], 0.4, label="Triton, best")
        ax.bar(
            [i + 0.2 for i in range(len(rows))], [r.get("inprocess_img_s", 0) for r in rows], 0.4, label="in-process"
        )
        ax.set_xticks(range(len(rows)), labels)
        ax.set_ylabel("images/s")
        ax.legend()

    write("summary", results, rows, columns, plot, out)
    return results


if __name__ == "__main__":
    main()

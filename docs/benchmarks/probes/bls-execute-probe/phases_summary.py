"""Summarize phases_model.py's lines: per run of executes with the same images per request (split where the
probe's lines pause over 0.5 s, the e2e harness's point boundaries), the median of each phase in ms.

    python docs/benchmarks/probes/bls-execute-probe/phases_summary.py $TMPDIR/pipeline-phases/*.jsonl
"""

import json
import statistics
import sys

lines = []
for path in sys.argv[1:]:
    with open(path) as file:
        lines += [json.loads(row) for row in file]
lines.sort(key=lambda r: r["at"])
points, last = [], None
for row in lines:
    if last is None or row["at"] - last > 0.5:
        points.append([])
    points[-1].append(row)
    last = row["at"]
names = ("decode", "resnet", "topk", "other")
print("executes  images/exec  requests/exec  " + "  ".join(f"{n:>7}" for n in names) + "    sum (ms, medians)")
for rows in points:
    if len(rows) < 5:
        continue
    med = {n: statistics.median(r.get(n, 0.0) for r in rows) for n in names}
    images = statistics.mean(r["images"] for r in rows)
    requests = statistics.mean(r["requests"] for r in rows)
    print(
        f"{len(rows):8d}  {images:11.1f}  {requests:13.2f}  "
        + "  ".join(f"{med[n]:7.2f}" for n in names)
        + f"    {sum(med.values()):6.2f}"
    )

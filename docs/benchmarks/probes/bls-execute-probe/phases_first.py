"""Each pipeline stub's first execute against its later ones, from phases_model.py's lines (one file per stub):
what a request pays when it is the first one an instance serves after load.

    python docs/benchmarks/probes/bls-execute-probe/phases_first.py $TMPDIR/pipeline-phases/*.jsonl
"""

import json
import statistics
import sys

names = ("decode", "resnet", "topk", "other")
print("stub      executes  " + "  ".join(f"{n:>13}" for n in names) + "   (ms: first / median of the rest)")
for path in sys.argv[1:]:
    with open(path) as file:
        rows = [json.loads(line) for line in file]
    if len(rows) < 2:
        continue
    first, rest = rows[0], rows[1:]
    cells = [f"{first.get(n, 0.0):6.2f}/{statistics.median(r.get(n, 0.0) for r in rest):5.2f}" for n in names]
    print(f"{path.rsplit('/', 1)[-1]:>9} {len(rows):9d}  " + "  ".join(f"{c:>13}" for c in cells))

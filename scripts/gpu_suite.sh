#!/usr/bin/env bash
# The baked project's whole test suite on one GPU machine, in two parts that each fit one device call (< 10 min;
# a GPU server loads its 14 stubs in 30-150 s, and each part starts its own session server):
#
#   scripts/gpu_bake.sh                      # here: bake into .gpu-bake/ (fp16, the default answers otherwise)
#   scripts/gpu_suite.sh OUT 1               # there, from the template root, after `source .gpu-bundle/activate`
#   scripts/gpu_suite.sh OUT 2               # the second call
#   scripts/gpu_suite.sh --merge A.xml B.xml >docs/benchmarks/h200-suite-COMMIT.xml    # here: one JUnit file
#
# Each part writes OUT/suite-N.xml (JUnit) and OUT/suite-N.log (pytest -v -rs, the servers' logs on failure).
set -uo pipefail
PARTS=(
  ""
  "tests/test_stages.py tests/test_weights.py tests/test_e2e.py tests/test_gpu.py tests/test_mps.py tests/test_customizing.py"
  "tests/test_reliability.py tests/test_shared_memory.py"
)
if [[ ${1:-} == --merge ]]; then
  shift
  exec python3 - "$@" <<'PY'
import sys
import xml.etree.ElementTree as ET

merged = ET.Element("testsuites")
for path in sys.argv[1:]:
    root = ET.parse(path).getroot()
    merged.extend(root if root.tag == "testsuites" else [root])
for key in ("tests", "failures", "errors", "skipped"):
    merged.set(key, str(sum(int(s.get(key, 0)) for s in merged)))
merged.set("time", f"{sum(float(s.get('time', 0)) for s in merged):.1f}")
ET.indent(merged)
print(ET.tostring(merged, encoding="unicode"))
PY
fi
out=$(realpath "$1")
part=$2
cd "$(dirname "$0")/../.gpu-bake/image-classifier"
pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || pip install -q --no-deps -e .
image-classifier weights random >/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 timeout -s TERM "${SUITE_LIMIT_S:-540}" pytest -v -rs -p no:cacheprovider ${PARTS[$part]} \
  --junitxml="$out/suite-$part.xml" 2>&1 | tee "$out/suite-$part.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed"

#!/usr/bin/env bash
# The baked project's whole test suite on one GPU machine, one part per device call (< 10 min each; a GPU server
# loads its 18 stubs in well under a minute):
#
#   scripts/gpu_bake.sh                      # here: bake into .gpu-bake/ (fp16, the default answers otherwise)
#   cp -r .gpu-extra /tmp/                   # there, in a call that carries only .gpu-extra (ruff, gevent wheels)
#   scripts/gpu_suite.sh OUT 1               # there, from the template root, after `source .gpu-bundle/activate`
#   scripts/gpu_suite.sh OUT 2               # the second call
#   scripts/gpu_suite.sh OUT 3               # the third
#   scripts/gpu_suite.sh OUT 4               # the fourth
#   scripts/gpu_suite.sh --merge A.xml B.xml >docs/benchmarks/h200-suite-COMMIT.xml    # here: one JUnit file
#
# Four parts of about 250-450 s each on an H100 (a call of 600 s), plus the ResNet's compile on each fresh machine
# (below: SUITE_COMPILE): part 1 is the reliability tests but the
# watchdog's and the guard's, part 2 the GPU, MPS, shared-memory and CLI tests (the CLI's start servers of their own),
# part 3 the watchdog's and the guard's, the compiled ResNet's and the customizing recipes', part 4 every other test
# file, so a new one is never left out (part 3 held them all until, at 140 tests, it outran a call). A test file or
# node id of the baked project (relative to its root, e.g. tests/test_customizing.py) instead of a part number runs
# just that (suite-custom.*). Each part stops like a Ctrl-C at SUITE_LIMIT_S after this script started (default
# 540 s, the install and the compile included, so that a call of 598 s has room to stop the servers and write) and
# writes OUT/suite-N.xml (JUnit, with each test's output) and OUT/suite-N.log (pytest -v -rs, the servers' logs on
# failure), and OUT/stubs.log: the stubs per model and the GPU's processes, once a second. `OUT 1 2` runs both side
# by side in one call, but on one H200 at the shipped counts that ran out of GPU resources (servers of both parts
# loading at once: "unable to create stream: out of memory"), so run one part per call there.
set -uo pipefail
here=$(realpath "$(dirname "$0")")
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
parts=("${@:2}")
[[ ${#parts[@]} -gt 0 ]] || { echo "usage: $0 OUT 1|2|3|4|TESTS (or --merge A.xml B.xml)" >&2; exit 2; }
customs=0
for part in "${parts[@]}"; do [[ $part == [1234] ]] || customs=$((customs + 1)); done
[[ $customs -le 1 ]] || { echo "$0: one test file or node id a call (they share suite-custom.*)" >&2; exit 2; }
cd "$here/../.gpu-bake/image-classifier"
pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || pip install -q --no-deps -e .
extra=/tmp/.gpu-extra  # gpu_bake.sh: ruff for the recipes' lint checks, gevent for the HTTP example (a call before)
if [[ -f $extra/ruff.xz ]]; then
  ruff=$(dirname "$(command -v python3)")/ruff
  xz -dc "$extra/ruff.xz" >"$ruff" && chmod +x "$ruff"
fi
[[ -d $extra/wheels ]] && pip install -q --no-index --no-deps "$extra"/wheels/*.whl
image-classifier weights random >/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The compiled ResNet (compiled.py): each fresh machine compiles it once for the suite's weights into its cache
# (torch.compile, `default`: about 20 s a batch size; SUITE_COMPILE=off tests eager), then every test server's resnet
# instances compile from that cache.
if [[ -n ${SUITE_COMPILE:-} ]]; then
  python -c "from image_classifier.model_repository import set_parameter as s; s('model_repository', 'resnet', 'compile', '$SUITE_COMPILE')"
fi
started=$SECONDS
image-classifier compile 2>&1 | grep -v "^  still" | tee "$out/compile.log"
echo "compile: $((SECONDS - started)) s"
# GPU tests first: should a part run out of time, what matters most has run.
first=(tests/test_reliability.py)
second=(tests/test_gpu.py tests/test_mps.py tests/test_shared_memory.py tests/test_cli.py)
third=(tests/test_compiled.py tests/test_customizing.py)
rest=()
for f in tests/test_*.py; do [[ " ${first[*]} ${second[*]} ${third[*]} " == *" $f "* ]] || rest+=("$f"); done
# pytest with Ctrl-C restored (a background job of a script ignores SIGINT): at SUITE_LIMIT_S it stops like a
# Ctrl-C, stops its servers and still writes its JUnit XML for the tests that ran.
PYTEST='import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main())'
name() { [[ $1 == [1234] ]] && echo "$1" || echo custom; }
run_part() {
  local files
  case $1 in
    1) files=("${first[@]}" -k "not watchdog and not guard") ;;
    2) files=("${second[@]}") ;;
    3) files=("${first[@]}" "${third[@]}" -k "not test_reliability or watchdog or guard") ;;
    4) files=("${rest[@]}") ;;
    *) files=("$1") ;;
  esac
  # the limit counts from this script's start: the install and the compile come out of it
  PYTHONUNBUFFERED=1 timeout -s INT -k 30 "$(( ${SUITE_LIMIT_S:-540} - SECONDS ))" python3 -c "$PYTEST" -v -rs -p no:cacheprovider -o junit_logging=system-out \
    "${files[@]}" --junitxml="$out/suite-$(name "$1").xml" >"$out/suite-$(name "$1").log" 2>&1
  echo "part $1: $(tail -n 1 "$out/suite-$(name "$1").log")"
}
# Once a second, for a failure's post-mortem: the stubs per model (a zombie is a dead stub the server has not
# reaped) and the processes on the GPU (under MPS its clients and the MPS server).
monitor() {
  while sleep 1; do
    stubs=$(ps -eo stat=,args= | awk '$2 ~ /triton_python_backend_stub$/ { n = split($3, p, "/"); c[p[n - 2]]++ }
      $1 ~ /^Z/ && $2 ~ /triton_python_b/ { c["zombie"]++ } END { for (k in c) printf " %s=%d", k, c[k] }')
    gpu=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)
    echo "$(date +%T) gpu-processes=$gpu$stubs"
  done >>"$out/stubs.log" 2>&1
}
monitor &
monitor_pid=$!
pids=()
for part in "${parts[@]}"; do
  run_part "$part" &
  pids+=($!)
done
wait "${pids[@]}"
kill "$monitor_pid" 2>/dev/null
grep -hE "(PASSED|FAILED|ERROR|SKIPPED)" "$out"/suite-*.log | grep -E "FAILED|ERROR|SKIPPED" | head -40
xmls=()
for part in "${parts[@]}"; do [[ -f $out/suite-$(name "$part").xml ]] && xmls+=("$out/suite-$(name "$part").xml"); done
[[ ${#xmls[@]} -gt 1 ]] && "$here/gpu_suite.sh" --merge "${xmls[@]}" >"$out/suite.xml"
exit 0

#!/usr/bin/env bash
# Measure and test a baked project on a GPU machine: how the figures in docs/benchmarks/ are made.
#
#   scripts/gpu_bake.sh                       # here: bake into .gpu-bake/ (fp16, the default answers otherwise)
#   scripts/gpu_run.sh OUT STEP [STEP ...]    # there: from the template root, after `source .gpu-bundle/activate`
#
# STEP is one word plus arguments for that script, quoted together:
#   "inprocess ARGS"  python -m benchmarks.inprocess   "e2e LABEL ARGS"  python -m benchmarks.e2e
#   "hop ARGS"        python -m benchmarks.hop         "pytest ARGS"     the baked project's tests
#   "soak ARGS"       python -m benchmarks.soak (memory over a long mixed load)
#   "stress ARGS"     python -m benchmarks.reload_stress (pipeline reloads under load, stubs killed; counts aborts)
#   "budgets ARGS"    python -m benchmarks.budgets (serve with no flag beside a process holding all but N GiB)
#   "overload ARGS"   python -m benchmarks.overload (each entry point at N x what it serves, deadlines, probe)
#   "sh COMMAND"      a shell command in the baked project, e.g. a sed on model_repository/*/config.pbtxt
#                     between two e2e steps (an instance-count sweep in one call)
#   "probe FILE"      serve FILE (a probe pipeline model.py, relative to the template root, e.g.
#                     docs/benchmarks/probes/bls-execute-probe/inprocess_preprocess_model.py) as the pipeline in the steps after it;
#                     the shipped model.py stays beside it as shipped_model.py (phases_model.py wraps it)
# A step may start with a time limit in seconds ("240 pytest tests/test_gpu.py").
# Everything goes to OUT/results.tgz (one folder per step, written after each step) and OUT/log.txt.
set -uo pipefail
out=$(realpath "$1")
shift
work=$(mktemp -d)
root=$(realpath "$(dirname "$0")/..")
cd "$root/.gpu-bake/image-classifier"
pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || pip install -q --no-deps -e .
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-$(cat ../COMMIT 2>/dev/null || echo unknown)}
image-classifier weights random
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for step in "$@"; do
  read -r -a words <<<"$step"
  limit=()
  if [[ ${words[0]} =~ ^[0-9]+$ ]]; then
    limit=(timeout -s TERM "${words[0]}")
    words=("${words[@]:1}")
  fi
  echo "=== $(date -u +%T) $step"
  case ${words[0]} in
    inprocess) "${limit[@]}" python -m benchmarks.inprocess "${words[@]:1}" --out "$work/inprocess" ;;
    hop) "${limit[@]}" python -m benchmarks.hop "${words[@]:1}" --out "$work/hop" ;;
    e2e) "${limit[@]}" python -m benchmarks.e2e "${words[@]:2}" --out "$work/e2e-${words[1]}" ;;
    pytest) "${limit[@]}" pytest "${words[@]:1}" -p no:cacheprovider ;;
    soak) "${limit[@]}" python -m benchmarks.soak "${words[@]:1}" --out "$work/soak" ;;
    stress) "${limit[@]}" python -m benchmarks.reload_stress "${words[@]:1}" --out "$work/stress" ;;
    budgets) "${limit[@]}" python -m benchmarks.budgets "${words[@]:1}" --out "$work/budgets" ;;
    overload) "${limit[@]}" python -m benchmarks.overload "${words[@]:1}" --out "$work/overload" ;;
    sh) "${limit[@]}" bash -c "${step#*sh }" ;;
    probe)  # the shipped model.py stays beside it as shipped_model.py, for a probe that wraps it (phases_model.py)
      version=model_repository/pipeline/1
      [[ -f $version/shipped_model.py ]] || cp "$version/model.py" "$version/shipped_model.py"
      cp "$root/${words[1]}" "$version/model.py" && echo "pipeline/1/model.py is now ${words[1]}" ;;
    *) echo "unknown step ${words[0]}" ;;
  esac
  tar -C "$work" -czf "$out/results.tgz" .
done 2>&1 | tee "$out/log.txt"

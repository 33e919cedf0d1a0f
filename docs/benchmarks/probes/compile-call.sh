#!/usr/bin/env bash
# One device call for the compiled ResNet (torch.compile from a cache, compiled.py), from the template root after
# `source .gpu-bundle/activate`, on a bake from scripts/gpu_bake.sh (fp16), within CALL_LIMIT_S (default 560 s):
#   1. `image-classifier compile` as serve runs it (the config's mode, default), cold, then again (cached), timed;
#   2. compile-probe.py: the stage's ceiling outside Triton: eager, CUDA graphs, compiled from the cache;
#   3. benchmarks.e2e: the pipeline and the ensemble through Triton, compiled and eager, one server after the other;
#   4. compile-probe.py's late steps (PROBE_LATE: the model alone, compiled with a dynamic batch cold and warm, then
#      at batch 128 in fp32/bf16/fp16), with the time left;
#   5. the GPU tests of the compiled path (PYTEST_K; empty: none), with the time left.
# Everything goes to OUT (logs, compile-probe.json, e2e.json/.md, suite JUnit XML).
set -uo pipefail
out=$(realpath "$1")
deadline=$((SECONDS + ${CALL_LIMIT_S:-560}))
left() { local n=$((deadline - SECONDS - ${1:-0})); echo $((n > 5 ? n : 5)); }
probe=$(realpath "$(dirname "$0")/compile-probe.py")
cd "$(dirname "$0")/../../../.gpu-bake/image-classifier"
pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
image-classifier weights random >/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
export TRITON_COMPILE_CACHE=/tmp/compiled PYTHONUNBUFFERED=1
for run in cold cached; do
  s=$SECONDS
  timeout "$(left 150)" image-classifier compile 2>&1 | tee "$out/compile-$run.log" | grep -v "^  still" | tail -n 3
  echo "=== compile ($run): rc ${PIPESTATUS[0]} in $((SECONDS - s)) s"
done
cat /tmp/compiled/*/ready.json 2>/dev/null | tee "$out/ready.json"
du -sh /tmp/compiled/* 2>/dev/null
echo "=== probe ($(left) s left)"
timeout "$(left 100)" python "$probe" "$out/probe" ${PROBE_STEPS:-eager-fp16 graph-fp16 compiled-default-fp16} 2>&1 | cut -c1-500
echo "=== e2e ($(left) s left)"
timeout "$(left 170)" python -m benchmarks.e2e --compile default off --points ${E2E_POINTS:-1x1 1x8 16x128} \
  --seconds "${E2E_SECONDS:-3}" --out "$out/e2e" 2>&1 | grep -v "^  " | tail -n 30
echo "=== precision ($(left) s left)"
timeout "$(left 20)" python "$probe" "$out/probe" ${PROBE_LATE-model-dynamic-fp16 model-dynamic-fp16 model-default-fp32 model-default-bf16 model-default-fp16} 2>&1 | cut -c1-500
echo "=== pytest ($(left) s left)"
[[ -n ${PYTEST_K-x} ]] && timeout -s INT "$(left)" python -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py \
  -k "${PYTEST_K-compiled_once or in_process_reference or kind_gpu}" --junitxml="$out/suite-compiled.xml" 2>&1 | tail -n 15
exit 0

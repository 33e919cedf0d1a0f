#!/usr/bin/env bash
# Deploy this project with docker compose, run the end-to-end suite against it over gRPC, always tear down.
#   scripts/compose_e2e.sh          GPU host (NVIDIA Container Toolkit)
#   scripts/compose_e2e.sh --cpu    no GPU (docker-compose.cpu.yml); CPU=1 does the same
# Needs Docker with Compose >= 2.24.4. HEALTH_TIMEOUT_S bounds the wait for a healthy server (default 900).
set -euo pipefail
cd "$(dirname "$0")/.."

files=(-f docker-compose.yml)
if [[ "${1:-}" == "--cpu" || -n "${CPU:-}" ]]; then
  files+=(-f docker-compose.cpu.yml)
fi
compose() { docker compose "${files[@]}" --profile tests "$@"; }

finish() {
  local status=$?
  if [[ $status -ne 0 ]]; then
    echo "compose e2e failed (exit $status); the server's last log lines:" >&2
    compose logs --no-color --tail 200 triton >&2 || true
  fi
  compose down -v --remove-orphans || true
  exit "$status"
}
trap finish EXIT

if [[ ! -f model_repository/resnet/1/weights.pt ]]; then
  echo "no ResNet weights yet: writing deterministic random ones (make weights-random)"
  make weights-random
fi

compose build
compose up -d --wait --wait-timeout "${HEALTH_TIMEOUT_S:-900}" triton
compose run --rm tests
echo "compose e2e passed"

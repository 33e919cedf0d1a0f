#!/usr/bin/env bash
# `docker compose up`, for real, on this CI machine's CPU (no GPU, no registry):
#   Docker Engine + Compose v2 (.ci/docker.sh), the stand-in base image (.ci/base_image.sh), then in a baked project:
#   build -> up --wait (CPU) -> the `tests` service's e2e suite over gRPC -> stop with requests in flight -> down -v.
# Needs the template's .venv (make test makes it). KEEP=1 keeps the baked project and the containers' logs.
set -euo pipefail
cd "$(dirname "$0")/.."
template="$PWD"
python="$template/.venv/bin/python"

step() {  # step NAME COMMAND...: run it, print how long it took
  local name="$1" started=$SECONDS
  shift
  echo "::: $name"
  "$@"
  echo "::: $name: $((SECONDS - started)) s"
  timings+=("$(printf '%-40s %5d s' "$name" $((SECONDS - started)))")
}
timings=()

step "docker engine and compose v2" bash .ci/docker.sh
step "stand-in base image" bash .ci/base_image.sh

workdir="$template/build/compose-ci"
rm -rf "$workdir"
"$template/.venv/bin/cookiecutter" --no-input --output-dir "$workdir" "$template"
project="$(find "$workdir" -mindepth 1 -maxdepth 1 -type d)"
cd "$project"
package="$("$python" -c 'import json; print(json.load(open(".cookiecutter.json"))["cookiecutter"]["package_name"])')"
grpc_port="$("$python" -c 'import json; print(json.load(open(".cookiecutter.json"))["cookiecutter"]["grpc_port"])')"
PYTHONPATH=src "$python" -m "$package.cli" weights random

# This machine's sandbox cannot raise RLIMIT_MEMLOCK (no CAP_SYS_RESOURCE, hard limit 8 MiB), so the compose
# file's `memlock: -1` would stop the container from starting: TRITON_MEMLOCK gives it the hard limit instead.
hard="$(ulimit -H -l)"
[[ "$hard" == unlimited ]] || export TRITON_MEMLOCK=$((hard * 1024))
compose=(docker compose -f docker-compose.yml -f docker-compose.cpu.yml --profile tests)
finish() {
  local status=$?
  if [[ $status -ne 0 ]]; then
    echo "compose step failed (exit $status); the server's last log lines:" >&2
    "${compose[@]}" logs --no-color --tail 200 triton >&2 || true
  fi
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  [[ -n "${KEEP:-}" ]] || rm -rf "$workdir"
  exit "$status"
}
trap finish EXIT

step "docker compose build" "${compose[@]}" build
step "docker compose up -d --wait (CPU)" "${compose[@]}" up -d --wait --wait-timeout 600 triton
step "tests service: e2e suite over gRPC" "${compose[@]}" run --rm tests
step "docker compose stop, requests in flight" \
  env PYTHONPATH=src "$python" "$template/.ci/stop_in_flight.py" "localhost:$grpc_port" "${compose[@]}"
step "docker compose down -v" "${compose[@]}" down -v --remove-orphans

echo "::: images"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^($(basename "$project")|python)"
printf '::: timings\n'
printf '  %s\n' "${timings[@]}"

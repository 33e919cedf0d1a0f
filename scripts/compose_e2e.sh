#!/usr/bin/env bash
# Bake this template into a temporary directory and run the generated project's compose e2e there:
# build -> up -> wait healthy -> end-to-end tests -> down. For a host with Docker (and a GPU, or --cpu).
#   scripts/compose_e2e.sh [--cpu] [key=value ...]     e.g. scripts/compose_e2e.sh max_batch_size=64
# Needs cookiecutter on PATH; KEEP=1 keeps the baked project.
set -euo pipefail
template="$(cd "$(dirname "$0")/.." && pwd)"

cpu=()
if [[ "${1:-}" == "--cpu" ]]; then
  cpu=(--cpu)
  shift
fi

workdir="$(mktemp -d)"
if [[ -z "${KEEP:-}" ]]; then
  trap 'rm -rf "$workdir"' EXIT
fi
cookiecutter --no-input --output-dir "$workdir" "$template" "$@"
project="$(find "$workdir" -mindepth 1 -maxdepth 1 -type d)"
echo "baked $project"
"$project/scripts/compose_e2e.sh" "${cpu[@]}"

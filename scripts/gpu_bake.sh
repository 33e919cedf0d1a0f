#!/usr/bin/env bash
# Bake the project measured on the GPU machine into .gpu-bake/ (ignored by git; carried to the device).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-bake
.venv/bin/cookiecutter --no-input -o .gpu-bake . precision=fp16 "$@"
# ruff for the customizing recipes' lint checks (the device has no package index; the bundle has no ruff)
.venv/bin/pip download -q --no-deps --only-binary :all: -d .gpu-bake/whl ruff
git rev-parse --short HEAD >.gpu-bake/COMMIT
git diff --quiet HEAD -- . ':!.gpu-bake' || echo "$(cat .gpu-bake/COMMIT)+changes" >.gpu-bake/COMMIT

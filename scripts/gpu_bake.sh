#!/usr/bin/env bash
# Bake the project measured on the GPU machine into .gpu-bake/ (ignored by git; carried to the device).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-bake
.venv/bin/cookiecutter --no-input -o .gpu-bake . "$@"  # the default precision (fp16)
# ruff for the customizing recipes' lint checks (the device has no package index; the bundle has no ruff): its
# binary alone, xz-compressed (7 MB instead of the wheel's 11), so that bundle, bake and tree stay within the
# device's 64 MiB carry; gpu_suite.sh unpacks it.
wheels=$(mktemp -d)
.venv/bin/pip download -q --no-deps --only-binary :all: -d "$wheels" ruff
mkdir -p .gpu-bake/bin
unzip -p "$wheels"/ruff-*.whl '*/scripts/ruff' | xz -9 -T0 >.gpu-bake/bin/ruff.xz
rm -rf "$wheels"
git rev-parse --short HEAD >.gpu-bake/COMMIT
git diff --quiet HEAD -- . ':!.gpu-bake' || echo "$(cat .gpu-bake/COMMIT)+changes" >.gpu-bake/COMMIT

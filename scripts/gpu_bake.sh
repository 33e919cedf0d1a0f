#!/usr/bin/env bash
# Bake the project measured on the GPU machine into .gpu-bake/ (ignored by git; carried to the device).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-bake
.venv/bin/cookiecutter --no-input -o .gpu-bake . "$@"  # the default precision (fp16)
# What the device lacks and the bundle, the bake and the tree leave no room for in one carry (64 MiB): ruff for the
# customizing recipes' lint checks (its binary alone, xz-compressed) and tritonclient[http]'s wheels (gevent,
# rapidjson: for the HTTP example test), into .gpu-extra/ (git-ignored). Carry it alone first, to a machine that stays warm:
#   run(carry=[".gpu-extra"], command="cp -r .gpu-extra /tmp/")     # then the suite's calls find /tmp/.gpu-extra
rm -rf .gpu-extra && mkdir -p .gpu-extra/wheels
wheels=$(mktemp -d)
.venv/bin/pip download -q --no-deps --only-binary :all: -d "$wheels" ruff
unzip -p "$wheels"/ruff-*.whl '*/scripts/ruff' | xz -9 -T0 >.gpu-extra/ruff.xz
rm -rf "$wheels"
.venv/bin/pip download -q --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d .gpu-extra/wheels gevent geventhttpclient python-rapidjson urllib3
git rev-parse --short HEAD >.gpu-bake/COMMIT
git diff --quiet HEAD -- . ':!.gpu-bake' ':!.gpu-extra' || echo "$(cat .gpu-bake/COMMIT)+changes" >.gpu-bake/COMMIT

# The alternative image: NVIDIA's Triton {{ cookiecutter.triton_version }} container (tritonserver {{ cookiecutter.__triton_server_version }}, the release of the local runtime,
# Python 3.10, CUDA 12.6, about 15 GB) with this package installed into the Python its Python-backend stubs run.
# Build it through docker-compose.ngc.yml, or: docker build -f docker/ngc.Dockerfile --target ngc .
# Stages: `ngc` serves; `ngc-tests` adds the test suite on top. docs/deployment.md says which image to choose.
ARG NGC_IMAGE=nvcr.io/nvidia/tritonserver:{{ cookiecutter.triton_version }}-py3
FROM ${NGC_IMAGE} AS ngc
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# torch 2.5.1 from PyPI is the CUDA 12.4 build (nvidia-*-cu12 wheels), which runs on this image's CUDA 12.6
# driver stack; numpy<2 because the {{ cookiecutter.__triton_server_version }} Python-backend stub sends empty tensors with numpy 2.
COPY docker/constraints-ngc.txt /tmp/constraints.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip install --constraint /tmp/constraints.txt torch torchvision "numpy<2"

WORKDIR /opt/{{ cookiecutter.project_slug }}
COPY pyproject.toml ./
COPY src/ src/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip install --constraint /tmp/constraints.txt . && rm -rf build src/*.egg-info

# The image's own unprivileged user (uid 1000); created if a future base image lacks it.
RUN id -u triton-server >/dev/null 2>&1 || useradd --uid 1000 --create-home triton-server; \
    mkdir -p /home/triton-server && chown triton-server: /home/triton-server
USER triton-server
ENV HOME=/home/triton-server

ARG WEIGHTS_IN_IMAGE=true
COPY model_repository/ model_repository/
RUN if [ "$WEIGHTS_IN_IMAGE" = true ] && [ ! -r model_repository/resnet/1/weights.pt ]; then \
      echo "model_repository/resnet/1/weights.pt is missing (or not readable by $(id -un)): run" \
           "'make weights-random' (offline) or 'make weights-pretrained' before building the image" >&2; \
      exit 1; \
    fi
# `serve` writes the instance counts it sizes for the GPU it finds into <model>/configs/ (sizing.py): those folders
# are the server user's; the rest of the model repository stays read-only to it.
USER root
RUN for model in model_repository/*/; do install -d -o triton-server "${model}configs"; done
USER triton-server

EXPOSE {{ cookiecutter.http_port }} {{ cookiecutter.grpc_port }} {{ cookiecutter.metrics_port }}
# The CLI starts the image's /opt/tritonserver/bin/tritonserver with the flags of server.server_flags().
CMD ["{{ cookiecutter.project_slug }}", "serve", "--container"]

FROM ngc AS ngc-tests
USER root
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m pip install --constraint /tmp/constraints.txt "pytest>=8" "pytest-timeout>=2.3"
COPY tests/ tests/
USER triton-server
CMD ["python3", "-m", "pytest", "-p", "no:cacheprovider", "-m", "e2e", "tests"]

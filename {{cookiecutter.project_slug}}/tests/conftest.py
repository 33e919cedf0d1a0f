"""Fixtures: test images, a model repository with deterministic random weights, and a real tritonserver.

By default the tests start their own local tritonserver. With TRITON_GRPC_URL set they use that running server
instead (the compose `tests` service does), and MODEL_REPOSITORY names the repository it serves, so that the
in-process reference loads the same weights.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import struct
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.grpc import model_config_pb2

from {{ cookiecutter.package_name }}.client import ImageClassifier
from {{ cookiecutter.package_name }}.compiled import compile_for_serve
from {{ cookiecutter.package_name }}.model_repository import (
    load_config,
    pixels_dtype,
    python_models,
    resnet_weights,
    set_instance_counts,
    top_k,
)
from {{ cookiecutter.package_name }}.server import ServerSettings, TritonServer, visible_gpus
from {{ cookiecutter.package_name }}.stages import Reference
from {{ cookiecutter.package_name }}.weights import write_random_versions

PROJECT = Path(__file__).resolve().parents[1]
EXTERNAL_GRPC_URL = os.environ.get("TRITON_GRPC_URL")
# Tests that start their own tritonserver or read its processes: not against a server started elsewhere.
local_server_only = pytest.mark.skipif(bool(EXTERNAL_GRPC_URL), reason="needs a local server it can inspect")
EXTERNAL_REPOSITORY = os.environ.get("MODEL_REPOSITORY")


def make_image(seed: int, size=(320, 240), mode="RGB", fmt="JPEG") -> bytes:
    """A deterministic picture: smooth color gradients plus a few rectangles, so JPEG stays faithful."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    channels = [
        np.sin(2 * np.pi * (rng.uniform(0.5, 3) * x + rng.uniform(0.5, 3) * y + rng.uniform())) for _ in range(3)
    ]
    rgb = ((np.stack(channels, -1) + 1) * 127.5).astype(np.uint8)
    for _ in range(4):
        x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
        rgb[y0 : y0 + h // 3, x0 : x0 + w // 3] = rng.integers(0, 256, 3)
    image = Image.fromarray(rgb).convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that is all header: it claims width x height pixels and holds none."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def image_input(images: list[bytes]) -> grpcclient.InferInput:
    """The IMAGE input for a batch of encoded images."""
    batch = np.array([[image] for image in images], dtype=object)
    tensor = grpcclient.InferInput("IMAGE", list(batch.shape), "BYTES")
    tensor.set_data_from_numpy(batch)
    return tensor


def infer(url: str, inputs: list, model: str = "pipeline") -> grpcclient.InferResult:
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer(model, inputs, client_timeout=120)


def metrics(server) -> dict[tuple[str, str], float]:
    """{(metric, model): value} of the server's Prometheus metrics that carry a model label and no other but its
    version: the project's own counters and gauge (counters.Counters, named without their package prefix and
    `_total`) and Triton's nv_inference_* ones."""
    url = f"http://localhost:{server.settings.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    found = re.findall(r'^(\w+)\{model="(\w+)"(?:,version="\d+")?\} (\S+)$', text, re.M)
    own = re.compile(r"{{ cookiecutter.package_name }}_(\w+?)(?:_total)?")
    return {((m[1] if (m := own.fullmatch(name)) else name), model): float(value) for name, model, value in found}


def assert_same_answers(a: dict, b: dict, repository: Path, atol: float = 1e-5) -> None:
    """Two answers of one server to the same images ({"SCORES", "CLASS_IDS", "LABELS"} arrays, a row per image).

    One ResNet instance, or the CPU: the same answer, scores to float noise (`atol`). Several ResNet instances on a GPU:
    each process autotunes its own cuDNN kernels (cudnn.benchmark), so two instances' logits for the same pixels
    differ (fp16: up to 0.06, measured on an H200 between two processes; bitwise equal with autotuning off, at half
    the speed). Then the top-1 class and label agree and the scores within the precision's rounding, and a
    near-tie further down the top-k may swap.
    """
    names = [name for name in ("CLASS_IDS", "LABELS") if name in a or name in b]  # an HTTP answer may lack one
    resnet = load_config(repository / "resnet")
    per_instance = torch.cuda.is_available() and sum(g.count for g in resnet.instance_group) > 1
    if not per_instance:
        np.testing.assert_allclose(a["SCORES"], b["SCORES"], atol=atol, rtol=0)
        for name in names:
            np.testing.assert_array_equal(a[name], b[name])
        return
    atol = 1e-3 if pixels_dtype(repository) == torch.float32 else 2e-2
    np.testing.assert_allclose(a["SCORES"], b["SCORES"], atol=atol, rtol=0)
    for name in names:
        np.testing.assert_array_equal(np.asarray(a[name])[:, 0], np.asarray(b[name])[:, 0])


def outputs(result: grpcclient.InferResult) -> dict:
    return {name: result.as_numpy(name) for name in ("SCORES", "CLASS_IDS", "LABELS")}


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """A copy of the project's model repository with deterministic random ResNet weights (its class count)."""
    if EXTERNAL_GRPC_URL:
        return Path(EXTERNAL_REPOSITORY or PROJECT / "model_repository")
    repo = tmp_path_factory.mktemp("triton") / "model_repository"
    shutil.copytree(PROJECT / "model_repository", repo, ignore=shutil.ignore_patterns("weights.pt", "__pycache__"))
    if not torch.cuda.is_available():
        # The shipped counts overlap stages on a GPU; on a CPU (2 cores in CI) extra stubs only cost load time and
        # memory, so the CPU tests run one instance per model. The GPU tests serve the shipped counts.
        set_instance_counts(repo, dict.fromkeys(python_models(repo), 1))
    write_random_versions(repo, seed=0)  # every resnet version (recipe 3 adds a second)
    if torch.cuda.is_available():  # as `serve` does: the compiled resnet, cached for every server of the session
        compile_for_serve(repo, visible_gpus())
    return repo


@pytest.fixture(scope="session")
def max_batch(model_repository) -> int:
    """The entry point's max_batch_size: no test sends a bigger batch."""
    return load_config(model_repository / "pipeline").max_batch_size


@pytest.fixture(scope="session")
def reference(model_repository, server) -> Reference:
    """The same stages and weights in-process, on the device the server uses: what the server must answer.

    A GPU server decodes JPEGs with nvJPEG, which differs from the CPU's libjpeg by a few levels per pixel, so its
    reference runs on the GPU too.
    """
    if EXTERNAL_GRPC_URL and not EXTERNAL_REPOSITORY:
        pytest.skip("set MODEL_REPOSITORY to the repository the server at TRITON_GRPC_URL serves")
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        kinds = {group.kind for group in client.get_model_config("preprocess").config.instance_group}
    on_gpu = model_config_pb2.ModelInstanceGroup.KIND_GPU in kinds
    if on_gpu and not torch.cuda.is_available():
        pytest.skip("the server preprocesses on a GPU; its reference needs CUDA here too")
    variant, weights = resnet_weights(model_repository)
    dtype = pixels_dtype(model_repository)
    return Reference(variant, weights, top_k(model_repository), device="cuda" if on_gpu else "cpu", dtype=dtype)


class RunningServer:
    """A server someone else started (TRITON_GRPC_URL): only its address."""

    def __init__(self, grpc_url: str):
        self.grpc_url = grpc_url


@pytest.fixture(scope="session")
def server(model_repository, tmp_path_factory):
    """A real tritonserver (the local runtime) on free loopback ports, serving every model."""
    if EXTERNAL_GRPC_URL:
        yield RunningServer(EXTERNAL_GRPC_URL)
        return
    log_path = tmp_path_factory.mktemp("log") / "tritonserver.log"
    with local_server(model_repository, log_path) as triton:
        yield triton
    print(f"tritonserver log: {log_path}")


@contextlib.contextmanager
def local_server(repository: Path, log_path: Path):
    """A ready tritonserver (the local runtime) on free loopback ports; the tail of its log if it fails to start."""
    settings = ServerSettings.on_free_ports(repository)
    with open(log_path, "w") as log, TritonServer(settings, container=False, log=log) as triton:
        try:
            triton.wait_ready(600)
        except Exception:
            print(log_path.read_text()[-5000:])
            raise
        yield triton
    assert settings.admin_key not in log_path.read_text(errors="replace"), "the admin key is in the server's log"


@pytest.fixture
def client(server):
    classifier = ImageClassifier(server.grpc_url, "pipeline")
    yield classifier
    classifier.close()

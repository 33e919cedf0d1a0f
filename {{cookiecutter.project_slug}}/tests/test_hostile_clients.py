"""Hostile clients against a real tritonserver: requests made to take the server's shared memory or CPU.

Each is refused with INVALID_ARGUMENT naming the cap it broke (preprocess's config: max_image_bytes,
max_request_bytes, max_request_pixels) before any pixel is decoded, its bytes never reach preprocess's stub, and
the next good request is answered. What Triton 2.51 forces: a request's bytes reach the entry model's stub region
before any model code runs, and the region keeps its size (docs/deployment.md, "Security"). So these tests have a
server of their own: the regions they grow are not the other tests' server's."""

import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import image_input, infer, local_server_only, make_image
from PIL import Image
from test_reliability import start_server
from tritonclient.utils import InferenceServerException

from {{ cookiecutter.package_name }}.images import RequestLimits
from {{ cookiecutter.package_name }}.model_repository import load_config, parameters

MiB = 1 << 20
pytestmark = local_server_only


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory):
    triton = start_server(model_repository, tmp_path_factory.mktemp("hostile"))
    yield triton
    triton.stop()


@pytest.fixture(scope="module")
def limits(model_repository) -> RequestLimits:
    return RequestLimits.from_parameters(parameters(model_repository / "preprocess"))


def entry_models(repository: Path) -> list[str]:
    return ["pipeline", *(["ensemble"] if (repository / "ensemble").is_dir() else [])]


def jpeg_sized(size: int) -> bytes:
    """`size` bytes that start as a JPEG: what the caps must refuse by their length alone."""
    return b"\xff\xd8\xff\xe0" + bytes(size - 4)


def refused(url: str, images: list[bytes], model: str) -> tuple[InferenceServerException, float]:
    """The error the server answers a request of these images with, and after how many seconds."""
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as info:
        infer(url, [image_input(images)], model)
    return info.value, time.monotonic() - started


def region_bytes(server) -> int:
    """The bytes of every stub region of this server in /dev/shm."""
    return sum(p.stat().st_size for p in Path("/dev/shm").glob(server.settings.shm_prefix + "*"))


def assert_serving(url: str, model: str) -> None:
    result = infer(url, [image_input([make_image(1)])], model)
    assert result.as_numpy("SCORES").shape[0] == 1, "the next good request is answered"


def test_an_image_over_max_image_bytes_is_refused_before_preprocess_copies_it(server, model_repository, limits):
    """200 MB in one element: refused by its length. In the pipeline the check comes before the BLS call, so the
    bytes grow only the pipeline stub's region (Triton put them there), never preprocess's too (twice the bytes)."""
    size = 200 * MiB
    assert size > limits.image_bytes
    before = region_bytes(server)
    error, seconds = refused(server.grpc_url, [jpeg_sized(size)], "pipeline")
    grown = region_bytes(server) - before
    print(f"200 MB element: refused in {seconds:.2f} s; stub regions grew by {grown // MiB} MiB")
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error
    assert f"image of {size} bytes: over max_image_bytes ({limits.image_bytes})" in error.message(), error
    assert grown <= size + 2 * server.settings.shm_growth_bytes, "the bytes reached one stub's region, not two"
    assert_serving(server.grpc_url, "pipeline")


@pytest.mark.parametrize("model", ["pipeline", "ensemble"])
def test_a_request_over_max_request_bytes_is_refused(server, model_repository, limits, model):
    """Five images of 60 MB: each under the image cap, together over the request's."""
    if model not in entry_models(model_repository):
        pytest.skip("this project was baked without the ensemble")
    each = 60 * MiB
    count = limits.request_bytes // each + 1
    assert each <= limits.image_bytes
    if count > load_config(model_repository / model).max_batch_size:
        pytest.skip(f"a full batch of images under max_image_bytes is under max_request_bytes ({limits.request_bytes})")
    error, seconds = refused(server.grpc_url, [jpeg_sized(each)] * count, model)
    print(f"{model}: {count} x 60 MB refused in {seconds:.2f} s")
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error
    assert f"request of {count * each} bytes: over max_request_bytes ({limits.request_bytes})" in error.message()
    assert_serving(server.grpc_url, model)


@pytest.fixture(scope="module")
def compressible_png() -> bytes:
    """A 40 MP PNG (8000 x 5000, the largest image max_image_pixels admits) of one colour: 120 MB of pixels in
    about 120 KB."""
    out = io.BytesIO()
    Image.new("RGB", (8000, 5000), (200, 30, 30)).save(out, format="PNG", compress_level=9)
    return out.getvalue()


@pytest.mark.parametrize("model", ["pipeline", "ensemble"])
def test_a_batch_of_compressible_40_mp_pngs_is_refused_before_decoding(
    server, model_repository, limits, compressible_png, model
):
    """A full batch of 40 MP PNGs, a few MB on the wire, would be 5 G pixels to decode on the host at batch 128:
    refused by the sum of their headers, before one is decoded."""
    if model not in entry_models(model_repository):
        pytest.skip("this project was baked without the ensemble")
    count = load_config(model_repository / model).max_batch_size
    if count * 40_000_000 <= limits.request_pixels:
        pytest.skip(f"a batch of {count} is under max_request_pixels ({limits.request_pixels})")
    error, seconds = refused(server.grpc_url, [compressible_png] * count, model)
    print(f"{model}: {count} x 40 MP PNG ({len(compressible_png) * count // MiB} MiB) refused in {seconds:.2f} s")
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error
    assert f"request of {count * 40_000_000} pixels: over max_request_pixels" in error.message(), error
    assert_serving(server.grpc_url, model)


def test_a_flood_of_oversize_requests_leaves_the_server_serving(server, model_repository, limits):
    """Sixteen clients at once, each sending an image just over the cap: every one refused, none lost, and the
    server answers the next good request."""
    size = limits.image_bytes + 1
    image = jpeg_sized(size)
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        errors = list(pool.map(lambda _: refused(server.grpc_url, [image], "pipeline")[0], range(16)))
    print(f"16 x {size // MiB} MiB at once: refused in {time.monotonic() - started:.2f} s")
    assert [e.status() for e in errors] == ["StatusCode.INVALID_ARGUMENT"] * 16, errors
    assert all("over max_image_bytes" in e.message() for e in errors), errors
    assert_serving(server.grpc_url, "pipeline")

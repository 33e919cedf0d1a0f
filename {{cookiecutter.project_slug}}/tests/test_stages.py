"""The stage code as plain PyTorch, without Triton."""

import io
import math

import numpy as np
import pytest
import torch
from conftest import make_image, png_header
from PIL import Image
from torchvision.transforms import v2

from {{ cookiecutter.package_name }}.images import InvalidImage, RequestLimits, RequestTooLarge, inspect_image
from {{ cookiecutter.package_name }}.model_repository import load_config, parameters, resnet_weights, top_k
from {{ cookiecutter.package_name }}.stages import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    RESIZE_PART_PIXELS,
    Classifier,
    Postprocess,
    Preprocess,
    _Image,
    imagenet_labels,
    resize_in_strips,
)
from {{ cookiecutter.package_name }}.weights import write_random


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty image"),
        (b"GIF89a not what we take", "not a JPEG or PNG"),
        (png_header(30000, 30000), "too large"),
        (png_header(8000, 6000), "too large"),
        (png_header(40000, 1), "too narrow"),
    ],
    ids=["empty", "not-an-image", "bomb-30000x30000", "over-limit", "thin-40000x1"],
)
def test_inspect_rejects_before_decoding(data, message):
    with pytest.raises(InvalidImage, match=message):
        inspect_image(data, max_pixels=40_000_000)


def test_inspect_reads_format_and_size():
    assert inspect_image(make_image(0, (64, 48), fmt="PNG"), 10**6) == ("PNG", 64, 48)
    assert inspect_image(make_image(0, (64, 48)), 10**6) == ("JPEG", 64, 48)


def test_preprocess_normalizes_a_uniform_image_exactly():
    out = io.BytesIO()
    Image.new("RGB", (300, 260), (128, 128, 128)).save(out, format="PNG")
    pixels = Preprocess()([out.getvalue()])
    assert pixels.shape == (1, 3, 224, 224) and pixels.dtype == torch.float32
    expected = (128 / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(pixels[0, :, 100, 100], expected)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "I;16"])
def test_preprocess_converts_every_mode_to_rgb(mode):
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    pixels = Preprocess()([make_image(1, mode=mode, fmt=fmt)])
    assert pixels.shape == (1, 3, 224, 224)
    assert torch.isfinite(pixels).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_preprocess_casts_to_the_configured_precision(dtype):
    assert Preprocess(dtype=dtype)([make_image(2)]).dtype == dtype


def test_batch_isolates_a_bad_group():
    good, bad = [make_image(3), make_image(4, fmt="PNG")], [make_image(5), b"garbage"]
    results = Preprocess().batch([good, bad, [make_image(6)]])
    assert results[0].shape == (2, 3, 224, 224) and results[2].shape == (1, 3, 224, 224)
    assert isinstance(results[1], InvalidImage)
    # the good groups get the very pixels they would get alone
    torch.testing.assert_close(results[0], Preprocess()(good))


def test_a_request_over_a_cap_fails_alone_and_before_any_decode():
    """Each cap (bytes an image, bytes a request, pixels a request by the headers) fails only its own group, and
    before anything is decoded: PNG headers that claim pixels and hold none would fail to decode otherwise."""
    good = make_image(0)
    n = len(good)
    preprocess = Preprocess(limits=RequestLimits(image_bytes=2 * n, request_bytes=4 * n, request_pixels=1_000_000))
    groups = [[good + bytes(2 * n)], [good + bytes(n // 2)] * 3, [png_header(800, 1000), png_header(400, 1000)], [good]]
    results = preprocess.batch(groups)
    assert all(isinstance(r, RequestTooLarge) for r in results[:3]), results
    assert str(results[0]) == f"image of {3 * n} bytes: over max_image_bytes ({2 * n})"
    assert str(results[1]) == f"request of {3 * (n + n // 2)} bytes: over max_request_bytes ({4 * n})"
    assert str(results[2]) == "request of 1200000 pixels: over max_request_pixels (1000000)"
    assert results[3].shape == (1, 3, 224, 224), "the good request is served"


def test_the_request_caps_in_the_config_are_the_code_defaults():
    """One default, stated in preprocess's config.pbtxt, in RequestLimits and in docs/deployment.md: the same."""
    from conftest import PROJECT

    limits = RequestLimits.from_parameters(parameters(PROJECT / "model_repository" / "preprocess"))
    assert limits == RequestLimits()
    stated = " ".join((PROJECT / "docs" / "deployment.md").read_text().split())  # and the docs say the same
    assert f"`max_image_bytes` {limits.image_bytes >> 20} MiB an image" in stated
    assert f"`max_request_bytes` {limits.request_bytes >> 20} MiB and `max_request_pixels` 1 G pixels" in stated
    assert limits.request_pixels == 1_000_000_000


@pytest.mark.parametrize("fraction", [1 / 3, 0.9, 0.999])
def test_a_truncated_jpeg_is_invalid_before_any_decode(fraction):
    # nvJPEG decodes a cut-off JPEG without complaint; the header check refuses it on every device alike.
    data = make_image(7)
    with pytest.raises(InvalidImage, match="truncated JPEG"):
        inspect_image(data[: int(len(data) * fraction)], max_pixels=40_000_000)
    with pytest.raises(InvalidImage, match="truncated JPEG"):
        Preprocess()([data[: int(len(data) * fraction)]])


def test_a_complete_jpeg_with_trailing_bytes_is_accepted():
    data = make_image(7) + b"\x00" * 16  # padding after the end-of-image marker, as some cameras write
    assert Preprocess()([data]).shape == (1, 3, 224, 224)


def test_batch_of_mixed_sizes_matches_each_image_alone():
    images = [make_image(20 + i, size=(200 + 40 * (i % 3), 150 + 30 * (i % 2))) for i in range(7)]
    together = Preprocess().batch([images[:3], images[3:]])
    alone = torch.cat([Preprocess()([image]) for image in images])
    torch.testing.assert_close(torch.cat(together), alone)


def smooth_image(width: int, height: int, fmt: str) -> bytes:
    """A photo-like image without pixel-level detail (gradients and a few soft shapes)."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x) * np.cos(4 * y)], axis=-1) * 255
    out = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(out, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_an_image_over_the_decode_budget_is_decoded_and_resized_on_the_host(fmt):
    """Over `decode_budget_pixels` an image never reaches the device at full size (what keeps a GPU preprocess's
    memory independent of max_image_pixels): it is decoded and resized on the host, a JPEG reduced as it decodes
    (libjpeg's DCT scaling, here 1/4: 2400x1800 -> 600x450). A PNG gives exactly what the full decode gives, a JPEG
    the same picture (mean |d| under 0.01 of the normalized range), and not the same bytes."""
    data = smooth_image(2400, 1800, fmt)
    small_budget = Preprocess(decode_budget_pixels=1_000_000)
    full, reduced = Preprocess()([data]), small_budget([data])
    assert reduced.shape == full.shape == (1, 3, 224, 224)
    if fmt == "PNG":
        torch.testing.assert_close(reduced, full)
    else:
        assert not torch.equal(reduced, full), "the JPEG was reduced as it decoded"
        assert (reduced - full).abs().mean() < 0.01 * (full.max() - full.min())
    together = small_budget.batch([[make_image(3), data, make_image(4)]])[0]  # among small images, in its slot
    torch.testing.assert_close(together[1:2], reduced)
    torch.testing.assert_close(together[::2], Preprocess()([make_image(3), make_image(4)]))


def test_a_chunk_resized_in_parts_gives_each_image_what_it_gives_alone():
    """On a GPU a decode chunk holds a whole batch, and its same-size center squares are converted to float and
    resized a part at a time (`RESIZE_PART_PIXELS`). The parts keep the order and put a square over the budget
    alone; a chunk of three parts, with an odd-sized image in the first so that its slots are not contiguous,
    resized as a GPU does it (here on the CPU), gives every image what it gives alone, in its own slot."""
    stage = Preprocess()
    side = stage.center_square(torch.empty(3, 375, 500)).shape[-1]  # of a 500x375 image
    per_part = RESIZE_PART_PIXELS // side**2
    squares = [(k, torch.zeros(3, side, side, dtype=torch.uint8)) for k in range(2 * per_part + 3)]
    parts = list(stage._resize_parts(squares))
    assert [len(part) for part in parts] == [per_part, per_part, 3]
    assert [k for part in parts for k, _ in part] == list(range(len(squares)))
    big = math.isqrt(2 * RESIZE_PART_PIXELS)
    assert [len(part) for part in stage._resize_parts([(k, torch.zeros(3, big, big)) for k in range(3)])] == [1, 1, 1]

    data = [make_image(seed, (500, 375)) for seed in range(2 * per_part + 3)]
    data.insert(per_part - 1, make_image(99, (320, 240)))
    items = [_Image(0, d, *inspect_image(d, stage.max_pixels)) for d in data]
    together = torch.full((len(items), 3, 224, 224), 7, dtype=torch.uint8)
    errors: dict = {}
    stage._decode_and_resize(list(enumerate(items)), together, errors)
    assert not errors
    for k, item in enumerate(items):
        alone = torch.empty((1, 3, 224, 224), dtype=torch.uint8)
        stage._decode_and_resize([(0, item)], alone, errors)
        torch.testing.assert_close(together[k], alone[0], msg=f"slot {k}")


@pytest.mark.parametrize("rows", [1, 8, 301])
def test_a_square_resized_in_strips_is_the_square_resized_at_once(rows):
    """`resize_in_strips` (on a GPU, a square over RESIZE_PART_PIXELS: its float copy a strip of rows at a time)
    gives what one antialiased resize of the whole square as float gives, whether the strips are one row, a few
    rows that do not divide the side, or the whole square; on a square that is not a multiple of anything."""
    square = torch.randint(0, 256, (3, 301, 301), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for size in (224, 24):
        at_once = v2.functional.resize(square.float().unsqueeze(0), [size, size], antialias=True)[0]
        torch.testing.assert_close(resize_in_strips(square, size, strip_pixels=301 * rows), at_once)


def test_postprocess_top_k_is_sorted_probabilities_with_labels():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    post = Postprocess(top_k=5)
    scores, class_ids = post(logits)
    assert scores.shape == class_ids.shape == (4, 5)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    torch.testing.assert_close(scores[:, 0], torch.softmax(logits, 1).max(1).values)
    labels = post.label(class_ids)
    assert labels.shape == (4, 5)
    assert labels[0, 0].decode() == imagenet_labels()[class_ids[0, 0]]


def test_imagenet_labels():
    labels = imagenet_labels()
    assert len(labels) == 1000 and labels[0] == "tench"


def test_random_weights_are_deterministic_and_load(tmp_path):
    a, b = write_random("resnet18", tmp_path / "a.pt", seed=3), write_random("resnet18", tmp_path / "b.pt", seed=3)
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    logits = Classifier("resnet18", a)(Preprocess()([make_image(8)]))
    assert logits.shape == (1, 1000) and logits.dtype == torch.float32


def test_model_repository_configs_parse_and_agree(model_repository):
    variant, weights = resnet_weights(model_repository)
    assert variant.startswith("resnet") and weights.is_file()
    assert top_k(model_repository) == load_config(model_repository / "pipeline").output[0].dims[0]
    for name in ("preprocess", "resnet", "postprocess", "pipeline"):
        config = load_config(model_repository / name)
        assert config.name == name and config.max_batch_size > 0
        assert np.isin(["FORCE_CPU_ONLY_INPUT_TENSORS"], list(config.parameters)).all()

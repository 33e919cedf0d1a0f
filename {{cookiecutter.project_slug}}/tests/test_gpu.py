"""GPU-only checks; they skip cleanly on a machine without CUDA."""

import pytest
import torch
from conftest import make_image

from {{ cookiecutter.package_name }}.stages import Preprocess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gpu_preprocess_decodes_on_the_device_and_matches_the_cpu():
    images = [make_image(i) for i in range(4)] + [make_image(9, fmt="PNG")]
    gpu = Preprocess("cuda:0")(images)
    assert gpu.device.type == "cuda"
    # nvJPEG and libjpeg differ by a few levels per pixel; resize averages that away.
    torch.testing.assert_close(gpu.cpu(), Preprocess()(images), atol=0.1, rtol=0)

"""The three pipeline stages as plain PyTorch, shared by the Triton models, the tests and the benchmarks."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ACCEPTED_FORMATS = ("JPEG", "PNG")
# Resizing the short side to 256 makes the long side 256 x the aspect ratio: a 40000x1 PNG of 92 bytes would
# ask for gigabytes. Panoramas up to this ratio are served.
MAX_ASPECT_RATIO = 32


class InvalidImage(ValueError):
    """The bytes are not an image the pipeline accepts: the client's fault, never the server's."""


def inspect_image(data: bytes, max_pixels: int) -> tuple[str, int, int]:
    """Read only the header and return (format, width, height); reject bombs before any pixel is decoded."""
    if not data:
        raise InvalidImage("empty image: the element holds no bytes")
    try:
        with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
            fmt, (width, height) = image.format, image.size
    except Image.DecompressionBombError as exc:
        raise InvalidImage(f"image too large: {exc}") from None
    except Exception:
        raise InvalidImage(f"not a JPEG or PNG image ({len(data)} bytes starting {data[:8]!r})") from None
    if width * height > max_pixels:
        raise InvalidImage(f"image too large: {width}x{height} is over the limit of {max_pixels} pixels")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InvalidImage(f"image too narrow: {width}x{height} is beyond the {MAX_ASPECT_RATIO}:1 aspect ratio limit")
    return fmt, width, height


class Preprocess:
    """Encoded JPEG/PNG bytes -> normalized [B, 3, crop, crop] pixels on `device`, in `dtype`.

    JPEGs are decoded on the GPU when `device` is a GPU (nvJPEG), everything else on the CPU.
    Grayscale, palette and alpha images are converted to RGB.
    """

    def __init__(self, device="cpu", dtype=torch.float32, resize=256, crop=224, max_pixels=40_000_000):
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_pixels = max_pixels
        self.resize_and_crop = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop)])
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)

    def decode(self, data: bytes) -> torch.Tensor:
        """One encoded image -> uint8 [3, H, W] on the device. Raises InvalidImage."""
        fmt, width, height = inspect_image(data, self.max_pixels)
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            if fmt == "JPEG" and self.device.type == "cuda":
                image = torchvision.io.decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
            else:
                image = torchvision.io.decode_image(encoded, mode=ImageReadMode.RGB)
        except RuntimeError:
            image = self._decode_with_pillow(data)
        if image.dtype != torch.uint8:  # 16-bit PNG
            image = v2.functional.to_dtype(image, torch.uint8, scale=True)
        if tuple(image.shape) != (3, height, width):
            raise InvalidImage(f"decoded {tuple(image.shape)} does not match the header's {width}x{height}")
        return image.to(self.device)

    @staticmethod
    def _decode_with_pillow(data: bytes) -> torch.Tensor:
        """Fallback for what libjpeg/libpng in torchvision refuse (CMYK JPEGs, some truncated files)."""
        try:
            with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
                rgb = np.asarray(image.convert("RGB"))
        except Exception as exc:
            raise InvalidImage(f"cannot decode image: {exc}") from None
        return torch.from_numpy(rgb.copy()).permute(2, 0, 1)

    def normalize(self, crops: list[torch.Tensor]) -> torch.Tensor:
        """Resized and cropped uint8 images -> one normalized [B, 3, crop, crop] batch in `dtype`."""
        pixels = (torch.stack(crops).float() / 255 - self.mean) / self.std
        return pixels.to(self.dtype)

    def batch(self, groups: list[list[bytes]]) -> list[torch.Tensor | InvalidImage]:
        """Preprocess several requests at once: one result per group, pixels or the group's first error.

        Each image is resized and cropped as soon as it is decoded, so at most one full-size image is held at a
        time; the crops are normalized together, and each group's pixels are a view into that one batch (no
        copy). A bad image fails its own group only.
        """
        decoded: list[list[torch.Tensor] | InvalidImage] = []
        for group in groups:
            try:
                decoded.append([self.resize_and_crop(self.decode(data)) for data in group])
            except InvalidImage as exc:
                decoded.append(exc)
        good = [images for images in decoded if not isinstance(images, InvalidImage)]
        if not good:
            return decoded
        pixels = self.normalize([image for images in good for image in images])
        results, offset = [], 0
        for images in decoded:
            if isinstance(images, InvalidImage):
                results.append(images)
            else:
                results.append(pixels[offset : offset + len(images)])
                offset += len(images)
        return results

    def __call__(self, images: list[bytes]) -> torch.Tensor:
        (result,) = self.batch([images])
        if isinstance(result, InvalidImage):
            raise result
        return result


def build_resnet(variant: str, weights: Path | str | None = None, num_classes: int | None = None) -> torch.nn.Module:
    """torchvision's architecture, with weights from a state-dict file (None: the untrained init).

    The class count is `num_classes`, else the weights' (rows of `fc.weight`), else ImageNet's 1000. Weights with
    another class count than `num_classes` raise a ValueError that says how to fix it.
    """
    state = None if weights is None else torch.load(weights, map_location="cpu", weights_only=True)
    found = state["fc.weight"].shape[0] if state is not None and "fc.weight" in state else None
    if num_classes is not None and found is not None and found != num_classes:
        raise ValueError(
            f"{weights} has {found} classes (fc.weight) but the model is configured for {num_classes}: "
            "write weights, labels.txt and config.pbtxt together with `weights import`"
        )
    model = torchvision.models.get_model(variant, weights=None, num_classes=num_classes or found or 1000)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


class Classifier:
    """Pixels -> FP32 logits [B, classes]. On the CPU, FP16 is computed in FP32 (CPU FP16 convolutions crawl)."""

    def __init__(self, variant: str, weights: Path | str | None, device="cpu", dtype=torch.float32, num_classes=None):
        self.device = torch.device(device)
        self.dtype = torch.float32 if (self.device.type == "cpu" and dtype == torch.float16) else dtype
        self.memory_format = torch.channels_last if self.device.type == "cuda" else torch.contiguous_format
        model = build_resnet(variant, weights, num_classes)
        self.model = model.to(self.device, self.dtype, memory_format=self.memory_format)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(self.device, self.dtype, memory_format=self.memory_format)
        return self.model(pixels).float()


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet class names, from torchvision's weight metadata (no download)."""
    return list(torchvision.models.ResNet50_Weights.IMAGENET1K_V2.meta["categories"])


def read_labels(path: Path | str) -> list[str]:
    """A Triton label file (`label_filename`): one class name per line, line i naming class i."""
    labels = Path(path).read_text(encoding="utf-8").splitlines()
    blank = [i + 1 for i, label in enumerate(labels) if not label.strip()]
    if not labels or blank:
        where = f"line {blank[0]} is blank" if blank else "it is empty"
        raise ValueError(f"{path}: {where}; write one class name per line, line i naming class i")
    return labels


class Postprocess:
    """Logits -> top-k softmax scores (descending), class ids and labels."""

    def __init__(self, top_k: int, labels: list[str] | None = None):
        self.top_k = top_k
        self.labels = np.array(labels or imagenet_labels(), dtype=object)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, class_ids = torch.softmax(logits.float(), dim=1).topk(self.top_k, dim=1)
        return scores, class_ids

    def label(self, class_ids: torch.Tensor) -> np.ndarray:
        """Class ids -> an object array of UTF-8 encoded names, the shape of `class_ids`."""
        names = self.labels[class_ids.cpu().numpy()]
        return np.vectorize(str.encode, otypes=[object])(names) if names.size else names


class Reference:
    """The whole pipeline in-process, no Triton: what the server must answer, and the speed ceiling."""

    def __init__(self, variant, weights, top_k, device="cpu", dtype=torch.float32, **preprocess_options):
        self.preprocess = Preprocess(device, dtype, **preprocess_options)
        self.classifier = Classifier(variant, weights, device, dtype)
        self.postprocess = Postprocess(top_k)

    def __call__(self, images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.postprocess(self.classifier(self.preprocess(images)))

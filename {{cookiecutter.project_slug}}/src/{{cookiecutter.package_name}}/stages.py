"""The three pipeline stages as plain PyTorch, shared by the Triton models, the tests and the benchmarks: preprocess
and postprocess here, the ResNet in resnet.py (imported here too)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

from .images import ACCEPTED_FORMATS, InvalidImage, RequestLimits, inspect_image
from .resnet import Classifier, batch_buckets, build_resnet  # noqa: F401 (the ResNet stage: found here too)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Decoded pixels a GPU preprocess holds at once (Preprocess): 128 images of 500x375 in one nvJPEG call. An image
# larger than this (up to max_image_pixels) is decoded and resized on the host, reduced while it decodes.
DECODE_BUDGET_PIXELS = 24_000_000
# Center squares converted to float and resized at once (Preprocess._resize_parts): 37 squares of a 500x375 JPEG.
# A larger square goes alone, its float copy made a strip of this many pixels at a time (resize_in_strips).
RESIZE_PART_PIXELS = 4_000_000


def preprocess_peak_bytes(
    max_batch_size: int,
    crop: int,
    dtype_bytes: int,
    decode_budget_pixels: int = DECODE_BUDGET_PIXELS,
    resize: int = 256,
) -> int:
    """The most GPU memory one batch of `max_batch_size` images can hold in Preprocess.

    One decode chunk (at most the decode budget: a larger image never reaches the GPU at full size): its RGB
    images (uint8), and one part of their center squares at a time (`RESIZE_PART_PIXELS`) stacked as uint8 and as
    float, with the part's resized float pixels (the antialiased resize needs no buffer of its own on a contiguous
    input), or the strips of one larger square (`resize_in_strips`: a part's worth of float pixels, and the square
    resized across, as tall as the largest square a budget's image holds); the batch's resized float pixels,
    normalized in place, and their cast to the output dtype. A quarter more for the caching allocator's rounding.
    Also what `serve` budgets for a preprocess instance (sizing.py)."""
    side = math.isqrt(int(decode_budget_pixels * min(1.0, (crop / resize) ** 2)))  # the largest center square
    chunk = decode_budget_pixels * 3 + RESIZE_PART_PIXELS * 3 * (1 + 4) + side * crop * 3 * 4
    pixels = max_batch_size * 3 * crop**2 * (4 + 4 + dtype_bytes)
    return (chunk + pixels) * 5 // 4


class Preprocess:
    """Encoded JPEG/PNG bytes -> normalized [B, 3, crop, crop] pixels on `device`, in `dtype`.

    The same geometry as Resize(resize) + CenterCrop(crop), done as crop-then-resize: the center square that would
    survive the crop is cut from the full image (a view, no copy) and resized straight to crop x crop, so no
    full-size resized image is ever made. On a GPU, the JPEGs of a whole batch are decoded by one nvJPEG call
    (torchvision's batched `decode_jpeg`), crops of the same size are resized by one kernel, and normalization
    is one fused multiply-add over the batch: no host sync until the pixels are handed on. PNGs (and what nvJPEG
    refuses: CMYK) decode on the CPU. An image over the decode budget (24 M pixels) is decoded and resized on the
    CPU, a JPEG reduced as it decodes, so the GPU memory a batch needs does not depend on `max_pixels`. Grayscale,
    palette and alpha images are converted to RGB.
    """

    def __init__(
        self,
        device="cpu",
        dtype=torch.float32,
        resize=256,
        crop=224,
        max_pixels=40_000_000,
        decode_budget_pixels=DECODE_BUDGET_PIXELS,
        limits: RequestLimits | None = None,
    ):
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.dtype = dtype
        self.resize, self.crop = resize, crop
        self.max_pixels = max_pixels
        self.limits = limits or RequestLimits()  # the caps of one request (images.py)
        self.on_host_decode = None  # called for each image decoded on the host (python_backend counts them)
        # At most this many decoded pixels are held at once on the device (a batch of 128 full-size 40 MP images
        # would be 15 GB); an image larger than that is decoded and resized on the host (`_on_host`).
        self.decode_budget_pixels = decode_budget_pixels
        mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)
        # (x / 255 - mean) / std as one multiply-add
        self.scale, self.shift = 1 / (255 * std), -mean / std
        if self.on_gpu:  # nvJPEG's and the kernels' one-time setup, here rather than in the first request
            self.batch([[_blank_jpeg(), _blank_jpeg()]])

    @classmethod
    def from_parameters(cls, device, dtype, parameters: dict[str, str]) -> Preprocess:
        """As the preprocess model is configured: its config's parameters (strings, as Triton gives them)."""
        return cls(
            device,
            dtype,
            resize=int(parameters["resize"]),
            crop=int(parameters["crop"]),
            max_pixels=int(parameters["max_image_pixels"]),
            limits=RequestLimits.from_parameters(parameters),
        )

    def peak_gpu_bytes(self, max_batch_size: int) -> int:
        """The most GPU memory one batch of `max_batch_size` images can hold (`preprocess_peak_bytes`). A process
        that runs only this stage caps its GPU memory there: `cap_gpu_memory`."""
        return preprocess_peak_bytes(
            max_batch_size, self.crop, self.dtype.itemsize, self.decode_budget_pixels, self.resize
        )

    def own_gpu_memory(self, max_batch_size: int) -> None:
        """For a process that runs this stage alone (a Triton instance): cap its GPU memory at the stage's peak
        (`cap_gpu_memory` at `peak_gpu_bytes`), then reach a full batch's working memory once, now: `max_batch_size`
        JPEGs that together fill the decode budget (a larger image is decoded on the host: `_on_host`).

        Without the second step memory climbs under traffic in steps: each batch larger than any before makes the
        caching allocator reserve bigger blocks and nvJPEG grow its own buffers (which the cap does not cover),
        60-100 MiB at a time, until the worst batch has been seen (measured in an H200 soak). After it, batches of
        such images fit in what is already held: 710 MiB a stub at the defaults, context included. Larger images
        are decoded a budget's worth at a time too, and a center square larger than a part goes to float a strip at
        a time (`resize_in_strips`), a part's worth of pixels: under batches of photos up to 6000x4000 a stub's
        torch memory rose 58 MiB past the warm-up's (142 before the strips; H100).
        """
        cap_gpu_memory(self.device, self.peak_gpu_bytes(max_batch_size))
        each = max(1, self.decode_budget_pixels // max(1, max_batch_size))
        self.batch([[_blank_jpeg(_four_by_three(min(each, self.max_pixels)))] * max_batch_size])
        torch.cuda.synchronize(self.device)

    def decode(self, data: bytes, fmt: str, width: int, height: int) -> torch.Tensor:
        """One encoded image -> uint8 [3, H, W] on the device. Raises InvalidImage."""
        if fmt == "JPEG" and self.on_gpu:
            try:
                image = self._decode_jpegs_on_gpu([torch.frombuffer(bytearray(data), dtype=torch.uint8)])[0]
                return self._checked(image, width, height)
            except RuntimeError:
                pass
        return self._decode_on_host(data, width, height).to(self.device)

    def _decode_on_host(self, data: bytes, width: int, height: int) -> torch.Tensor:
        """One encoded image -> uint8 [3, H, W] in host memory (libjpeg, libpng; Pillow for what they refuse)."""
        try:
            image = torchvision.io.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)
        except RuntimeError:
            image = self._decode_with_pillow(data)
        return self._checked(image, width, height)

    def _on_host(self, item: _Image) -> torch.Tensor:
        """An image over the decode budget -> its uint8 [3, crop, crop] pixels, decoded and resized in host memory,
        so that neither the full-size image nor its float copy is ever held on the device. A JPEG is reduced while
        it decodes (libjpeg's DCT scaling, through Pillow's `draft`: 1/2, 1/4 or 1/8) to the smallest size whose
        short side is still at least `resize`: a 40 MP photo decodes at 1/8, in a few milliseconds. Raises
        InvalidImage."""
        if self.on_host_decode is not None:
            self.on_host_decode()
        if item.fmt != "JPEG":
            image = self._decode_on_host(item.data, item.width, item.height)
        else:
            image = self._decode_with_pillow(item.data, short_side=self.resize)
        return self._resize([self.center_square(image)])[0]

    def _decode_jpegs_on_gpu(self, encoded: list[torch.Tensor]) -> list[torch.Tensor]:
        # torchvision's CUDA decoder can write into memory that work still queued on this stream reads
        # (pytorch/vision#9606, seen on H100s): drain the stream first.
        torch.cuda.current_stream(self.device).synchronize()
        return torchvision.io.decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)

    @staticmethod
    def _checked(image: torch.Tensor, width: int, height: int) -> torch.Tensor:
        if image.dtype != torch.uint8:  # 16-bit PNG
            image = v2.functional.to_dtype(image, torch.uint8, scale=True)
        if tuple(image.shape) != (3, height, width):
            raise InvalidImage(f"decoded {tuple(image.shape)} does not match the header's {width}x{height}")
        return image

    @staticmethod
    def _decode_with_pillow(data: bytes, short_side: int | None = None) -> torch.Tensor:
        """Fallback for what libjpeg/libpng/nvJPEG in torchvision refuse (CMYK JPEGs). With `short_side`, a JPEG is
        reduced as it decodes (Pillow's `draft`) to the smallest size whose short side is still at least that."""
        try:
            with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
                if short_side is not None:
                    scale = min(image.size) / short_side
                    image.draft("RGB", (math.ceil(image.width / scale), math.ceil(image.height / scale)))
                rgb = np.asarray(image.convert("RGB"))
        except Exception as exc:
            raise InvalidImage(f"cannot decode image: {exc}") from None
        return torch.from_numpy(rgb.copy()).permute(2, 0, 1)

    def center_square(self, image: torch.Tensor) -> torch.Tensor:
        """The part of `image` that Resize(resize) + CenterCrop(crop) keeps, as a view."""
        height, width = image.shape[-2:]
        side = max(1, min(height, width, round(min(height, width) * self.crop / self.resize)))
        top, left = (height - side) // 2, (width - side) // 2
        return image[..., top : top + side, left : left + side]

    def _resize(self, squares: list[torch.Tensor]) -> torch.Tensor:
        """Same-size [3, s, s] uint8 squares -> [n, 3, crop, crop], antialiased bilinear: in uint8 on the CPU (its
        fast path), in float on a GPU, where one square over `RESIZE_PART_PIXELS` goes in strips (`resize_in_strips`),
        so that its float copy is never held whole."""
        size = [self.crop, self.crop]
        if not squares[0].is_cuda:
            return v2.functional.resize(torch.stack(squares), size, antialias=True)
        if len(squares) == 1 and squares[0].shape[-1] ** 2 > RESIZE_PART_PIXELS:
            return resize_in_strips(squares[0], self.crop, RESIZE_PART_PIXELS).unsqueeze(0)
        return v2.functional.resize(torch.stack(squares).float(), size, antialias=True)

    def batch(self, groups: list[list[bytes]]) -> list[torch.Tensor | InvalidImage]:
        """Preprocess several requests at once: one result per group, pixels or the group's first error.

        The images of all groups become one batch, and each group's pixels are a view into it (no copy). A bad
        image fails its own group only. Decoded images are held at most `decode_budget_pixels` at a time on a
        GPU, and one at a time on the CPU; an image over that budget is decoded and resized on the host (`_on_host`).
        A group over a cap of `limits` fails before any of its images is decoded.
        """
        errors: dict[int, InvalidImage] = {}
        items: list[_Image] = []
        starts = []
        for g, group in enumerate(groups):
            starts.append(len(items))
            try:
                self.limits.check_bytes(len(data) for data in group)
                inspected = [_Image(g, data, *inspect_image(data, self.max_pixels)) for data in group]
                self.limits.check_pixels(sum(item.width * item.height for item in inspected))
                items += inspected
            except InvalidImage as exc:
                errors[g] = exc
        resized = torch.empty(
            (len(items), 3, self.crop, self.crop),
            dtype=torch.float32 if self.on_gpu else torch.uint8,
            device=self.device,
        )
        for chunk in self._chunks(items, errors):
            if len(chunk) == 1 and chunk[0][1].width * chunk[0][1].height > self.decode_budget_pixels:
                slot, item = chunk[0]  # over the budget: alone in its chunk (_chunks), and never full-size here
                try:
                    resized[slot] = self._on_host(item).to(self.device)
                except InvalidImage as exc:
                    errors.setdefault(item.group, exc)
                continue
            self._decode_and_resize(chunk, resized, errors)  # its images are freed on return, before the next
        if not items:
            pixels = resized
        elif self.on_gpu:  # normalized in place: the batch's float pixels are held once
            pixels = torch.addcmul(self.shift, resized, self.scale, out=resized).to(self.dtype)
        else:
            pixels = torch.addcmul(self.shift, resized.float(), self.scale).to(self.dtype)
        return [
            errors[g] if g in errors else pixels[starts[g] : starts[g] + len(group)] for g, group in enumerate(groups)
        ]

    def _decode_and_resize(self, chunk: list, resized: torch.Tensor, errors: dict[int, InvalidImage]) -> None:
        """Decode a chunk's images and write their resized center squares into their slots of `resized`; a bad
        image's error goes to `errors`, under its group."""
        same_size: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (slot, item), image in zip(chunk, self._decode_chunk([item for _, item in chunk])):
            if isinstance(image, InvalidImage):
                errors.setdefault(item.group, image)
            elif item.group not in errors:
                square = self.center_square(image)
                same_size.setdefault(square.shape[-1], []).append((slot, square))
        # one resize per crop size and part: on a GPU the images of one camera share a kernel
        for squares in same_size.values():
            for part in self._resize_parts(squares):
                slots = [slot for slot, _ in part]
                out = self._resize([square for _, square in part])
                if slots == list(range(slots[0], slots[-1] + 1)):
                    resized[slots[0] : slots[-1] + 1] = out
                else:
                    resized[torch.tensor(slots, device=self.device)] = out

    def _resize_parts(self, squares: list[tuple[int, torch.Tensor]]):
        """Same-size (slot, square) pairs in parts of at most `RESIZE_PART_PIXELS` (a larger square alone): the
        float copy a resize needs is made of one part at a time, not of the whole batch (165 MB at batch 128 of
        500x375 JPEGs, against 48 MB), at a few kernels per batch."""
        side = squares[0][1].shape[-1]
        step = max(1, RESIZE_PART_PIXELS // (side * side))
        for start in range(0, len(squares), step):
            yield squares[start : start + step]

    def _chunks(self, items: list[_Image], errors: dict[int, InvalidImage]):
        """(slot, item) lists holding at most the decode budget of pixels (one image on the CPU)."""
        chunk, pixels = [], 0
        for slot, item in enumerate(items):
            if item.group in errors:
                continue
            if chunk and (not self.on_gpu or pixels + item.width * item.height > self.decode_budget_pixels):
                yield chunk
                chunk, pixels = [], 0
            chunk.append((slot, item))
            pixels += item.width * item.height
        if chunk:
            yield chunk

    def _decode_chunk(self, items: list[_Image]) -> list[torch.Tensor | InvalidImage]:
        """Decode images; on a GPU all JPEGs in one nvJPEG call, the rest one by one."""
        decoded: list[torch.Tensor | InvalidImage | None] = [None] * len(items)
        jpegs = [k for k, item in enumerate(items) if item.fmt == "JPEG"] if self.on_gpu else []
        if jpegs:
            encoded = [torch.frombuffer(bytearray(items[k].data), dtype=torch.uint8) for k in jpegs]
            try:
                images = self._decode_jpegs_on_gpu(encoded)
            except RuntimeError:  # one undecodable image fails the whole call: those are decoded one by one below
                images = [None] * len(jpegs)
            for k, image in zip(jpegs, images):
                if image is not None:
                    try:
                        decoded[k] = self._checked(image, items[k].width, items[k].height)
                    except InvalidImage as exc:
                        decoded[k] = exc
        for k, item in enumerate(items):
            if decoded[k] is None:
                try:
                    decoded[k] = self.decode(item.data, item.fmt, item.width, item.height)
                except InvalidImage as exc:
                    decoded[k] = exc
        return decoded

    def __call__(self, images: list[bytes]) -> torch.Tensor:
        (result,) = self.batch([images])
        if isinstance(result, InvalidImage):
            raise result
        return result


def resize_in_strips(square: torch.Tensor, size: int, strip_pixels: int) -> torch.Tensor:
    """A [3, s, s] uint8 square -> [3, size, size] float: what one antialiased bilinear resize of its float copy
    gives, up to float rounding, while at most `strip_pixels` of that copy are held at a time. Strips of rows are
    converted and resized across (each row on its own), then the [3, s, size] result is resized down: the filter
    is separable, and a resize that keeps a side leaves that side as it is."""
    height = square.shape[-2]
    rows = max(1, strip_pixels // square.shape[-1])
    across = torch.empty((3, height, size), dtype=torch.float32, device=square.device)
    for top in range(0, height, rows):
        strip = square[:, top : top + rows]  # a view; its float copy is not named, so it is freed before the next
        across[:, top : top + rows] = v2.functional.resize(strip.float(), [strip.shape[-2], size], antialias=True)
    return v2.functional.resize(across, [size, size], antialias=True)


def cap_gpu_memory(device: torch.device, cap_bytes: int, reclaim_at: float = 0.6) -> None:
    """Bound this process's PyTorch memory on `device` at `cap_bytes`, so that it cannot ratchet past it. For a
    process that runs one stage (a Triton instance), never for one that holds several (the in-process reference).

    Batches of varied sizes and images of varied shapes leave the caching allocator with cached blocks that fit
    no later request, and it reserves new ones: reserved memory ratchets up. Under the cap it returns unused
    cached blocks to the driver before it would pass the cap, and once more than `reclaim_at` of the cap is
    reserved it returns the oldest unused ones first (garbage_collection_threshold, which needs the cap). Only a
    batch that needs more than the cap at once fails (CUDA out of memory, that batch's requests alone). No
    expandable segments: the tensors handed to other stubs go through CUDA IPC, which those do not support.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    torch.cuda.memory._set_allocator_settings(f"garbage_collection_threshold:{reclaim_at}")


def _four_by_three(pixels: int) -> tuple[int, int]:
    """The largest 4:3 (width, height) with at most `pixels` pixels."""
    height = max(1, int((pixels * 3 / 4) ** 0.5))
    return max(1, min(pixels // height, height * 4 // 3)), height


def _blank_jpeg(size=(64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (128, 128, 128)).save(out, format="JPEG")
    return out.getvalue()


class _Image(NamedTuple):
    group: int
    data: bytes
    fmt: str
    width: int
    height: int


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
        # encoded once: labelling a batch is one numpy gather, no per-element Python
        self.labels = np.array([name.encode() for name in labels or imagenet_labels()], dtype=object)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, class_ids = torch.softmax(logits.float(), dim=1).topk(self.top_k, dim=1)
        return scores, class_ids

    def to_host(self, logits: torch.Tensor) -> dict[str, np.ndarray]:
        """Logits -> {"SCORES", "CLASS_IDS", "LABELS"} as numpy: top-k where the logits are, then one small copy
        of the results to the host (they only go back to the client, and labels are strings: host only)."""
        scores, class_ids = self(logits)
        scores, class_ids = scores.cpu().numpy(), class_ids.cpu().numpy()
        return {"SCORES": scores, "CLASS_IDS": class_ids, "LABELS": self.label(class_ids)}

    def warm(self, device: torch.device, classes: int, max_batch_size: int) -> None:
        """For a process that serves this stage (a Triton instance on a GPU): run it once now, at the smallest and
        the largest batch, so that no request pays CUDA's lazy loading of its kernels. Without it the first top-k
        of a stub took 57-78 ms on an H200, once per instance after every load (16 pipeline instances: the first
        16 requests, or more); afterwards 0.35 ms."""
        for rows in sorted({1, max(1, max_batch_size)}):
            self.to_host(torch.zeros(rows, classes, device=device))

    def label(self, class_ids: torch.Tensor | np.ndarray) -> np.ndarray:
        """Class ids -> an object array of UTF-8 encoded names, the shape of `class_ids`."""
        if isinstance(class_ids, torch.Tensor):
            class_ids = class_ids.cpu().numpy()
        return self.labels[class_ids]


class Reference:
    """The whole pipeline in-process, no Triton: what the server must answer, and the speed ceiling."""

    def __init__(self, variant, weights, top_k, device="cpu", dtype=torch.float32, **preprocess_options):
        self.preprocess = Preprocess(device, dtype, **preprocess_options)
        self.classifier = Classifier(variant, weights, device, dtype)
        self.postprocess = Postprocess(top_k)

    def __call__(self, images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.postprocess(self.classifier(self.preprocess(images)))

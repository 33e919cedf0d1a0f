"""What the pipeline accepts as an image, read from its header before any pixel is decoded: the format, the size, the
aspect ratio, a JPEG's end, and the caps on one request (bytes an image, bytes and pixels a request)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass

from PIL import Image

ACCEPTED_FORMATS = ("JPEG", "PNG")
# Resizing the short side to 256 makes the long side 256 x the aspect ratio: a 40000x1 PNG of 92 bytes would
# ask for gigabytes. Panoramas up to this ratio are served.
MAX_ASPECT_RATIO = 32


class InvalidImage(ValueError):
    """The bytes are not an image the pipeline accepts: the client's fault, never the server's."""


class RequestTooLarge(InvalidImage):
    """A request over one of the preprocess model's caps (RequestLimits): refused before any pixel is decoded."""


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the preprocess stage: bytes per image, bytes per request and decoded pixels per
    request, from the preprocess model's config (max_image_bytes, max_request_bytes, max_request_pixels). Far above
    what a camera sends (a 40 MP JPEG is about 20 MB), they bound the work and the shared memory one request takes:
    a request of 128 compressible 40 MP PNGs is 15 MB on the wire and 5 G pixels to decode."""

    image_bytes: int = 64 << 20
    request_bytes: int = 256 << 20
    request_pixels: int = 1_000_000_000

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> RequestLimits:
        return cls(
            int(parameters["max_image_bytes"]),
            int(parameters["max_request_bytes"]),
            int(parameters["max_request_pixels"]),
        )

    def check_bytes(self, sizes: Iterable[int]) -> None:
        """Raise RequestTooLarge, naming the cap, for an image or a request of more bytes than its cap."""
        total = 0
        for size in sizes:
            if size > self.image_bytes:
                raise RequestTooLarge(f"image of {size} bytes: over max_image_bytes ({self.image_bytes})")
            total += size
        if total > self.request_bytes:
            raise RequestTooLarge(f"request of {total} bytes: over max_request_bytes ({self.request_bytes})")

    def check_pixels(self, pixels: int) -> None:
        """Raise RequestTooLarge for a request whose images hold more pixels, by their headers, than its cap."""
        if pixels > self.request_pixels:
            raise RequestTooLarge(f"request of {pixels} pixels: over max_request_pixels ({self.request_pixels})")


JPEG_START_OF_SCAN, JPEG_END_OF_IMAGE = b"\xff\xda", b"\xff\xd9"


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
    if fmt == "JPEG":
        # nvJPEG decodes a cut-off JPEG without complaint (libjpeg refuses it): the same bytes must get the same
        # answer on every device, so a JPEG must end its last scan with the end-of-image marker.
        last_scan = data.rfind(JPEG_START_OF_SCAN)
        if last_scan < 0 or data.rfind(JPEG_END_OF_IMAGE) < last_scan:
            raise InvalidImage(f"truncated JPEG: no end-of-image marker after the last scan ({len(data)} bytes)")
    return fmt, width, height

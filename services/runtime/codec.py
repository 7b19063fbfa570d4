"""Images in and out, with the cost of a decode bounded by limits checked before it.

Only JPEG, PNG, WebP and BMP are opened (415 for anything else, so that no exotic
decoder ever sees a caller's bytes). Before any pixel is decoded: the dimensions from
the header (413 for a pixel bomb) and, for JPEG, the number of scans and segments from
a marker walk (413 for a scan bomb). A JPEG that the model will shrink anyway is
decoded at reduced scale by libjpeg's DCT scaling (``draft``), for a fraction of the
cost. EXIF orientation is applied, so pixels are as the camera meant them. Everything
here is CPU work: the runtime calls it in its executor, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from services.runtime import jpeg
from services.runtime.errors import ApiError

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP")
OUTPUT_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}
MIME_TO_FORMAT = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp"}
# our own pixel check runs first; PIL's must not raise a different error for the same thing
Image.MAX_IMAGE_PIXELS = None
_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM")


@dataclass(frozen=True)
class DecodeLimits:
    max_pixels: int
    max_jpeg_scans: int = 32
    max_image_markers: int = 512


@dataclass
class DecodedImage:
    rgb: np.ndarray      # H x W x 3, uint8; possibly reduced (see scale)
    width: int           # the image's size as oriented, before any reduction
    height: int
    format: str
    scale: float = 1.0   # rgb width / width: < 1 when decoded at reduced scale


def _looks_allowed(data: bytes) -> bool:
    return data.startswith(_SIGNATURES) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def decode_image(data: bytes, limits: DecodeLimits, max_side: int | None = None) -> DecodedImage:
    """Decode once, within limits; `max_side` lets a JPEG decode at reduced scale (never
    below max_side on its long side: the caller resizes the rest of the way)."""
    if not data:
        raise ApiError(400, "empty_image", "the image is empty")
    if data[:2] == b"\xff\xd8":
        try:
            jpeg.walk(data, limits.max_jpeg_scans, limits.max_image_markers)
        except jpeg.JpegLimitError as exc:
            raise ApiError(413, "image_too_complex", f"{exc}: decoding it would cost too much") from None
    try:
        im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        if _looks_allowed(data):  # the right magic bytes, broken inside
            raise ApiError(400, "corrupt_image", "the image header is corrupt") from None
        raise ApiError(415, "unsupported_image", f"not an image in one of {', '.join(ALLOWED_FORMATS)}") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the caller's bad data
        raise ApiError(400, "corrupt_image", f"cannot read the image header: {exc}") from None
    width, height = im.size
    if width <= 0 or height <= 0:
        raise ApiError(400, "corrupt_image", "the image has no pixels")
    if width * height > limits.max_pixels:
        raise ApiError(413, "too_many_pixels",
                       f"{width}x{height} = {width * height} pixels is over the limit of {limits.max_pixels}")
    fmt = im.format or ""
    try:
        orientation = im.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block is not worth refusing the image for
        orientation = 1
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    try:
        if fmt == "JPEG" and max_side and max(width, height) > 2 * max_side:
            s = max_side / max(width, height)
            im.draft(None, (math.ceil(im.size[0] * s), math.ceil(im.size[1] * s)))
        im.load()
        if orientation != 1:
            im = ImageOps.exif_transpose(im)
        if im.mode != "RGB":
            im = im.convert("RGB")
        rgb = np.asarray(im)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ApiError(400, "corrupt_image", f"cannot decode the image: {exc}") from None
    return DecodedImage(rgb, width, height, fmt, rgb.shape[1] / width)


def decode_base64(text: Any, name: str, max_bytes: int | None = None) -> bytes:
    """A base64 field (a data: URL prefix is allowed); 422 when not a string, 400 when garbled."""
    if not isinstance(text, str):
        raise ApiError(422, "invalid_parameter", f"{name}: expected a base64 string")
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if max_bytes is not None and len(text) * 3 // 4 > max_bytes:
        raise ApiError(413, "body_too_large", f"{name}: over the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_base64", f"{name}: not valid base64") from None


def choose_format(asked: str | None, accept: str, default: str = "png") -> str:
    """The output format: the one asked for, else the first image type Accept names."""
    if asked:
        return asked
    for item in accept.split(","):
        mime = item.split(";", 1)[0].strip().lower()
        if mime in MIME_TO_FORMAT:
            return MIME_TO_FORMAT[mime]
    return default


def encode_image(rgb: np.ndarray, fmt: str, quality: int | None = None) -> tuple[bytes, str]:
    """Encoder settings favour speed: PNG at the lowest compression level, WebP at its
    fastest method; JPEG quality 90 unless asked."""
    pil_fmt, mime = OUTPUT_FORMATS[fmt]
    buf = io.BytesIO()
    if pil_fmt == "PNG":
        kwargs: dict[str, Any] = {"compress_level": 1}
    elif pil_fmt == "JPEG":
        kwargs = {"quality": quality or 90}
    else:
        kwargs = {"quality": quality or 85, "method": 0}
    Image.fromarray(rgb).save(buf, format=pil_fmt, **kwargs)
    return buf.getvalue(), mime


class Timing:
    """Per-request stage durations, for Server-Timing, metrics and logs."""

    STAGES = ("decode", "queue", "infer", "encode")

    def __init__(self, t0: float | None = None):
        import time
        self.t0 = time.perf_counter() if t0 is None else t0
        self.stages: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def header(self) -> str:
        return ", ".join(f"{k};dur={v * 1000:.2f}" for k, v in self.stages.items())

"""Image input and output: three input forms, limits checked before the work, decode once.

Input: a raw body with an ``image/*`` content type, multipart field ``image``, or JSON
``{"image": "<base64>"}``. The body size is capped while it is read (413); the
dimensions are read from the header before any pixel is decoded (413 for a pixel
bomb); only JPEG, PNG, WebP and BMP are opened (415 for anything else, so that no
exotic decoder ever sees a caller's bytes); a corrupt image is 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError
from starlette.requests import Request

from services.runtime.errors import ApiError

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP")
OUTPUT_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}
# our own pixel check runs first; PIL's must not raise a different error for the same thing
Image.MAX_IMAGE_PIXELS = None


@dataclass
class DecodedImage:
    rgb: np.ndarray          # H x W x 3, uint8
    width: int
    height: int
    format: str


@dataclass
class ImageRequest:
    image: DecodedImage
    params: dict[str, Any] = field(default_factory=dict)  # other fields of a JSON or multipart body
    raw_image: bytes = b""


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise ApiError(413, "body_too_large", f"body of {declared} bytes is over the limit of {max_bytes}")
        except ValueError:
            raise ApiError(400, "bad_request", "invalid Content-Length") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, "body_too_large", f"body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # later form() parsing reads this instead of the spent stream
    return body


SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM")


def _looks_allowed(data: bytes) -> bool:
    return data.startswith(SIGNATURES) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    if not data:
        raise ApiError(400, "empty_image", "the image is empty")
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
    if width * height > max_pixels:
        raise ApiError(413, "too_many_pixels",
                       f"{width}x{height} = {width * height} pixels is over the limit of {max_pixels}")
    try:
        im.load()
        rgb = np.asarray(im.convert("RGB"))
    except Exception as exc:  # noqa: BLE001
        raise ApiError(400, "corrupt_image", f"cannot decode the image: {exc}") from None
    return DecodedImage(rgb, width, height, im.format or "")


def decode_base64(text: Any, name: str) -> bytes:
    """A base64 field (a data: URL prefix is allowed); 422 when not a string, 400 when garbled."""
    if not isinstance(text, str):
        raise ApiError(422, "invalid_parameter", f"{name}: expected a base64 string")
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_base64", f"{name}: not valid base64") from None


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    body = await read_body(request, max_bytes)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "bad_json", "the body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise ApiError(422, "invalid_parameter", "body: expected a JSON object")
    return doc


async def read_image_request(request: Request, max_bytes: int, max_pixels: int,
                             image_field: str = "image") -> ImageRequest:
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype.startswith("image/"):
        data = await read_body(request, max_bytes)
        return ImageRequest(decode_image(data, max_pixels), {}, data)
    if ctype == "application/json":
        doc = await read_json_object(request, max_bytes)
        if image_field not in doc:
            raise ApiError(422, "invalid_parameter", f"{image_field}: field required")
        data = decode_base64(doc.pop(image_field), image_field)
        return ImageRequest(decode_image(data, max_pixels), doc, data)
    if ctype == "multipart/form-data":
        await read_body(request, max_bytes)
        try:
            form = await request.form(max_files=4, max_fields=64)
        except Exception as exc:  # noqa: BLE001 - a broken multipart body is the caller's
            raise ApiError(400, "bad_multipart", f"cannot parse the multipart body: {exc}") from None
        part = form.get(image_field)
        if part is None or isinstance(part, str):
            raise ApiError(422, "invalid_parameter", f"{image_field}: expected a file field")
        data = await part.read()
        params = {k: v for k, v in form.items() if k != image_field and isinstance(v, str)}
        return ImageRequest(decode_image(data, max_pixels), params, data)
    raise ApiError(415, "unsupported_media_type",
                   f"content type {ctype or '(none)'!r}: send image/*, multipart/form-data or application/json")


def encode_image(rgb: np.ndarray, fmt: str, quality: int = 90) -> tuple[bytes, str]:
    pil_fmt, mime = OUTPUT_FORMATS[fmt]
    buf = io.BytesIO()
    kwargs = {"quality": quality} if pil_fmt in ("JPEG", "WEBP") else {"compress_level": 1}
    Image.fromarray(rgb).save(buf, format=pil_fmt, **kwargs)
    return buf.getvalue(), mime


class Timing:
    """Per-request stage durations, for Server-Timing, metrics and logs."""

    STAGES = ("decode", "queue", "infer", "encode")

    def __init__(self):
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def header(self) -> str:
        return ", ".join(f"{k};dur={v * 1000:.2f}" for k, v in self.stages.items())

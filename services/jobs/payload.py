"""A submit, from bytes to a NewJob: the envelope, the body sent to the service, and the
structural checks that hold whether or not the service is on this unit (the base64 is well
formed, the image is a JPEG/PNG/WebP/BMP of bounded size and pixel count, read from its
header: only the first bytes are decoded, never the image).

Everything here is CPU work on caller-sized data: the app runs it in an executor, and a big
submit in a helper process (digest_submit).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.jobs.settings import valid_route
from services.runtime.codecs.forms import parse_json
from services.runtime.codecs.params import field_path
from services.runtime.edge.json_items import check_json_items
from services.runtime.errors import ApiError

SERVICE_RE = r"^[a-z][a-z0-9_-]{0,31}$"  # pydantic's (Rust) regex: "$" is the very end
IMAGE_FIELDS = ("image", "style_image", "mask")
IMAGE_LIST_FIELDS = ("init_images",)
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP")
SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM")
# base64 as A1111 takes it, once its MIME line breaks are dropped: the standard alphabet, its padding
# (possessive: text that fails is not backtracked through, 0.7 s for 27 MB)
B64_RE = re.compile(r"[A-Za-z0-9+/]*+={0,2}")
# chunks before a PNG's pixels (segments before a JPEG's first scan) walked to find what Pillow
# would inflate or step through: past this no service takes the picture (their
# max_image_markers goes to 100 000), and Pillow would read them all one by one in Python to
# open it (1.5 million in 18 MB: 2.6 s of CPU)
PNG_WALK_CHUNKS = 100_000
HEAD_STEPS = (64 * 1024, 1024 * 1024, None)   # bytes decoded to find the header: a JPEG's may lie past EXIF/ICC


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    service: str = Field(..., pattern=SERVICE_RE)
    route: str = Field(..., max_length=256)
    model: str | None = Field(None, max_length=512)
    params: dict[str, Any] | None = None
    image: str | None = None
    body: dict[str, Any] | None = None
    priority: Literal["high", "normal", "low"] = "normal"


@dataclass
class Limits:
    max_image_bytes: int
    max_pixels: int
    max_body_bytes: int | None = None   # the target service's own body limit, when known


def parse_envelope(raw: bytes, max_depth: int, max_items: int | None = None) -> SubmitRequest:
    """The submit, validated: 413 for JSON of over ``max_items`` items (counted before it is
    parsed, as every service's bodies are), 400 for JSON nested deeper than ``max_depth``
    (the runtime's own parser: no RecursionError), 422 for NaN or infinite numbers and
    wrong types."""
    if max_items is not None:
        check_json_items(raw, max_items, max_depth)
    doc = parse_json(raw, max_depth)
    if not isinstance(doc, dict):
        raise ApiError(422, "invalid_parameter", "body: expected a JSON object")
    try:
        req = SubmitRequest.model_validate(doc)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = field_path(e["loc"], "request")
        raise ApiError(422, "invalid_parameter", f"{where}: {e['msg']}") from None
    if not valid_route(req.route):
        raise ApiError(422, "invalid_parameter", "route: expected a path such as /api/v1/img2img (letters, "
                       "digits, '_', '-', '.'; no '.' or '..' segment)")
    if req.body is not None and (req.params is not None or req.image is not None):
        raise ApiError(422, "invalid_parameter", "body: send either 'body' or 'params'/'image', not both")
    return req


def service_body(req: SubmitRequest) -> dict[str, Any]:
    if req.body is not None:
        return req.body
    body = dict(req.params or {})
    if req.image is not None:
        body["image"] = req.image
    return body


def _b64_text(text: Any, name: str) -> str:
    """The base64 text of an image field without its MIME line breaks (as A1111 accepts
    them), checked for what costs nothing to check: its length and its padding. Its whole
    alphabet is checked by check_image_b64, after the cheaper refusals."""
    if not isinstance(text, str):
        raise ApiError(422, "invalid_parameter", f"{name}: expected a base64 string")
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if "\n" in text or "\r" in text:
        text = text.replace("\r", "").replace("\n", "")
    if len(text) % 4:
        raise ApiError(400, "bad_base64", f"{name}: not valid base64 (its length is not a multiple of 4)")
    if _padding(text) > 2:
        raise ApiError(400, "bad_base64", f"{name}: not valid base64")
    return text


def _padding(text: str) -> int:
    tail = text[-3:]
    return len(tail) - len(tail.rstrip("="))


def _decoded_size(text: str) -> int:
    return len(text) // 4 * 3 - _padding(text)


def check_image_b64(text: Any, name: str, limits: Limits) -> tuple[int, int, int]:
    """An image field, from its header only: its size is known from the base64 length, and
    only the first bytes are decoded (more only when the header lies further in, as a JPEG's
    after big EXIF or ICC segments). The service decodes the image once, when the job runs.
    The cheap refusals come first: a field whose first bytes are no picture (415) or whose
    length is over the limit (413) is refused before its whole text is scanned (40 ms for
    27 MB, in a helper process that 200 junk submits keep busy)."""
    text = _b64_text(text, name)
    size = _decoded_size(text)
    if size <= 0:
        raise ApiError(400, "empty_image", f"{name}: the image is empty")
    for step, head_bytes in enumerate(HEAD_STEPS):
        chars = len(text) if head_bytes is None else min(len(text), 4 * -(-head_bytes // 3))
        try:
            head = base64.b64decode(text[:chars], validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "bad_base64", f"{name}: not valid base64") from None
        complete = chars == len(text)
        if not complete and not _known_signature(head):
            complete = True  # no format of ours starts like this: more bytes will not change it
        if step == 0:
            if not _known_signature(head):  # (then complete, just above)
                check_image(head, name, limits, True)  # 415, or 400 for what claims a format
            if size > limits.max_image_bytes:
                raise ApiError(413, "image_too_large",
                               f"{name}: {size} bytes is over the limit of {limits.max_image_bytes}")
            if not B64_RE.fullmatch(text):
                raise ApiError(400, "bad_base64", f"{name}: not valid base64")
        dims = check_image(head, name, limits, complete)
        if dims is not None:
            return size, dims[0], dims[1]
    raise AssertionError("the last step decodes the whole image")  # pragma: no cover


def _known_signature(data: bytes) -> bool:
    return data.startswith(SIGNATURES) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def check_image(data: bytes, name: str, limits: Limits, complete: bool = True) -> tuple[int, int] | None:
    """The image's format, dimensions and pixel count from its header: (width, height). With
    ``complete`` False, ``data`` is the start of the image only: None when its header lies further."""
    from PIL import Image, UnidentifiedImageError  # the header only: no pixel is decoded here

    if not data:
        raise ApiError(400, "empty_image", f"{name}: the image is empty")
    if len(data) > limits.max_image_bytes:
        raise ApiError(413, "image_too_large",
                       f"{name}: {len(data)} bytes is over the limit of {limits.max_image_bytes}")
    header = _without_compressed_parts(data, name)
    try:
        with Image.open(io.BytesIO(header), formats=ALLOWED_FORMATS) as im:
            width, height = im.size
    except Image.DecompressionBombError:
        raise ApiError(413, "too_many_pixels", f"{name}: the image declares more pixels than {limits.max_pixels}") \
            from None
    except UnidentifiedImageError:
        if not complete:
            return None
        if _known_signature(data):
            raise ApiError(400, "corrupt_image", f"{name}: the image header is corrupt") from None
        raise ApiError(415, "unsupported_image", f"{name}: not an image in one of {', '.join(ALLOWED_FORMATS)}") \
            from None
    except Exception as exc:  # noqa: BLE001 - any header failure is the caller's bad data
        if not complete:
            return None
        raise ApiError(400, "corrupt_image", f"{name}: cannot read the image header: {exc}") from None
    if width <= 0 or height <= 0:
        raise ApiError(400, "corrupt_image", f"{name}: the image has no pixels")
    check_dims(name, len(data) if complete else 0, width, height, limits)
    return width, height


def _without_compressed_parts(data: bytes, name: str) -> bytes | memoryview:
    """A PNG's header without its zTXt/iTXt/iCCP chunks, which Pillow would inflate to open it
    (up to 64 MB of text from a 65 kB file; 4 GB of profiles from a 4 MB one). Only the chunks
    before the pixels are walked (the header's), within PNG_WALK_CHUNKS: 413 past it. A JPEG's
    header without the fill and extraneous bytes Pillow would step through a byte at a time in
    Python (5.5 s for 20 MB of 0xFF) and without its EXIF parsed tag by tag
    (services.runtime.codecs.jpeg, as the services read it)."""
    from services.runtime.codecs.png_bmp import PNG_SIGNATURE, FormatLimitError, header_for_pillow, walk_png
    if data[:2] == b"\xff\xd8":
        from services.runtime.codecs import jpeg
        try:
            return jpeg.header_for_pillow(data, jpeg.walk(data, 1, PNG_WALK_CHUNKS, header_only=True))
        except jpeg.JpegLimitError as exc:
            raise ApiError(413, "image_too_complex", f"{name}: {exc} before its first scan: no service takes it") \
                from None
    if not data.startswith(PNG_SIGNATURE):
        return data
    try:
        return header_for_pillow(data, walk_png(data, PNG_WALK_CHUNKS, header_only=True))
    except FormatLimitError as exc:
        raise ApiError(413, "image_too_complex", f"{name}: {exc} before its pixels: no service takes it") from None


def check_dims(name: str, size: int, width: int, height: int, limits: Limits) -> None:
    if size > limits.max_image_bytes:
        raise ApiError(413, "image_too_large", f"{name}: {size} bytes is over the limit of {limits.max_image_bytes}")
    if width * height > limits.max_pixels:
        raise ApiError(413, "too_many_pixels",
                       f"{name}: {width}x{height} pixels is over the limit of {limits.max_pixels}")


def check_images(body: dict[str, Any], limits: Limits) -> list[tuple[str, int, int, int]]:
    """Every image field of the body: base64 that holds a bounded image. Returns each one's
    (name, bytes, width, height)."""
    seen = []
    for key in IMAGE_FIELDS:
        if key in body and body[key] is not None:
            seen.append((key, *check_image_b64(body[key], key, limits)))
    for key in IMAGE_LIST_FIELDS:
        items = body.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise ApiError(422, "invalid_parameter", f"{key}: expected a list of base64 images")
        for i, item in enumerate(items[:16]):
            seen.append((f"{key}.{i}", *check_image_b64(item, f"{key}.{i}", limits)))
    return seen


def encode_body(body: dict[str, Any], limits: Limits) -> tuple[bytes, str]:
    try:
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): json.loads takes it, UTF-8 cannot hold it
        raise ApiError(422, "invalid_parameter", "params: a string holds an unpaired surrogate (\\ud800-\\udfff), "
                       "which is not Unicode text") from None
    except ValueError:
        raise ApiError(422, "invalid_parameter", "params: NaN and infinity are not JSON") from None
    check_body_size(len(data), limits)
    return data, hashlib.sha256(data).hexdigest()


def check_body_size(size: int, limits: Limits) -> None:
    if limits.max_body_bytes is not None and size > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"the request for the service is {size} bytes, over its limit "
                       f"of {limits.max_body_bytes}")


def build_body(req: SubmitRequest, limits: Limits) -> tuple[bytes, str]:
    """Checks the images and returns the service's JSON body and its digest."""
    body = service_body(req)
    check_images(body, limits)
    return encode_body(body, limits)


@dataclass
class Digest:
    """A submit parsed and checked against the unit's own limits, made where its CPU cost
    hurts least (a helper process for big bodies: parsing and encoding 30 MB of JSON holds
    the GIL for tens of milliseconds, and the probes with it). Picklable: errors travel as
    (status, code, message). ``check`` applies the chosen model's tighter limits later."""
    parsed: bool = False                      # the envelope was valid: service, route and model are known
    service: str = ""
    route: str = ""
    model: str | None = None
    priority: str = "normal"
    body: bytes = b""
    sha: str = ""
    images: list[tuple[str, int, int, int]] = field(default_factory=list)
    error: tuple[int, str, str] | None = None

    def raise_error(self) -> None:
        if self.error is not None:
            raise ApiError(*self.error)

    def check(self, limits: Limits) -> None:
        for name, size, width, height in self.images:
            check_dims(name, size, width, height, limits)
        check_body_size(len(self.body), limits)


def digest_submit(raw: bytes, max_depth: int, limits: Limits, max_items: int | None = None) -> Digest:
    d = Digest()
    try:
        req = parse_envelope(raw, max_depth, max_items)
        d.parsed, d.service, d.route, d.model, d.priority = True, req.service, req.route, req.model, req.priority
        body = service_body(req)
        d.images = check_images(body, limits)
        d.body, d.sha = encode_body(body, Limits(limits.max_image_bytes, limits.max_pixels))
    except ApiError as exc:
        d.error = (exc.status, exc.code, exc.message)
    return d

"""What an encode hook may answer, and the picture and base64 helpers it may use.

An encode hook returns a dict or a list (JSON; big base64 strings from ``encode_base64``
are spliced in rather than scanned), a pydantic model (JSON), ``bytes``
(application/octet-stream), ``onecard.image(rgb)`` (a picture in the format the client's
Accept asks for) or an ``onecard.Response`` (any body, media type, status and headers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from services.runtime.codecs.base64_text import decode_base64, encode_base64
from services.runtime.codecs.encoder_limits import check_encodable
from services.runtime.codecs.images import ALLOWED_FORMATS, ImageHeader, encode_image, resize_image
from services.runtime.codecs.page_release import hand_back_pages
from services.runtime.pipeline.model_routes import Reply, json_reply

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from onecard._request import Request

__all__ = ["IMAGE_FORMATS", "ImageHeader", "Response", "check_encodable", "decode_base64", "encode_base64",
           "encode_image", "encode_image_base64", "image", "resize_image"]

# what a request's pictures may be; anything else is refused with 415 before a decoder sees it
IMAGE_FORMATS: tuple[str, ...] = ALLOWED_FORMATS


@dataclass
class Response:
    """An answer with its own media type, status or headers. ``body`` is bytes, text (UTF-8)
    or anything JSON can hold (a dict, a list)."""
    body: Any
    media_type: str | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ImageAnswer:
    rgb: Any
    format: str | None = None
    quality: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


def image(rgb: np.ndarray, format: str | None = None, quality: int | None = None,
          headers: dict[str, str] | None = None) -> ImageAnswer:
    """A picture answer (height x width x 3 RGB, uint8), encoded in the encode hook's thread:
    ``format`` "png", "jpeg" or "webp", default the first the client's Accept names, else
    PNG; ``quality`` for JPEG and WebP."""
    return ImageAnswer(rgb, format, quality, dict(headers or {}))


def encode_image_base64(rgb: np.ndarray | Image.Image, fmt: str, quality: int | None = None,
                        texts: dict[str, str] | None = None, exif: bytes | None = None) -> str:
    """encode_image's file as base64 text, for a JSON answer. The file itself is let go with its
    pages handed back first, the GIL released (freeing a 119 MB PNG held it 8 ms)."""
    garbage = [encode_image(rgb, fmt, quality, texts, exif)[0]]
    text = encode_base64(garbage[0])
    hand_back_pages(garbage)
    garbage.clear()
    return text


def to_reply(answer: Any, request: Request) -> Reply:
    """An encode hook's answer as the bytes the runtime sends."""
    if isinstance(answer, Reply):
        return answer
    if isinstance(answer, ImageAnswer):
        fmt = answer.format or request.answer_format()
        data, mime = encode_image(answer.rgb, fmt, answer.quality)
        return Reply(data, mime, answer.headers)
    if isinstance(answer, Response):
        reply = _body_reply(answer.body, answer.media_type)
        reply.status = answer.status
        reply.headers = {**reply.headers, **answer.headers}
        return reply
    return _body_reply(answer, None)


def _body_reply(body: Any, media_type: str | None) -> Reply:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return Reply(bytes(body), media_type or "application/octet-stream")
    if isinstance(body, str) and media_type is not None:
        return Reply(body.encode("utf-8"), media_type)
    if isinstance(body, BaseModel):
        body = body.model_dump(mode="json")
    reply = json_reply(body)
    if media_type is not None:
        reply.media_type = media_type
    return reply

"""An image and its parameters, from any of the three input forms a route accepts.

A raw body with an ``image/*`` content type (parameters in the query string), a
multipart form (file field ``image``, other fields as text), or a JSON object
(``{"image": "<base64>", ...typed fields}``). Runs in the CPU pool, inside a decode hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.runtime.body import RawRequest, parse_json_object, parse_multipart, text_fields
from services.runtime.codec import DecodedImage, DecodeLimits, decode_base64, decode_image
from services.runtime.errors import ApiError
from services.runtime.params import as_text, merge
from services.runtime.settings import RuntimeSettings


def decode_limits(settings: RuntimeSettings) -> DecodeLimits:
    return DecodeLimits(settings.max_pixels, settings.max_jpeg_scans, settings.max_image_markers)


@dataclass
class ImageInput:
    image: DecodedImage
    params: dict[str, Any]                                    # typed (JSON) or Text (query, form)
    extra_images: dict[str, bytes] = field(default_factory=dict)  # other image fields, still encoded


def read_json(raw: RawRequest, settings: RuntimeSettings) -> dict[str, Any]:
    if raw.content_type != "application/json":
        raise ApiError(415, "unsupported_media_type",
                       f"content type {raw.content_type or '(none)'!r}: send application/json")
    return parse_json_object(raw.body, settings.max_json_depth, settings.max_fields)


def read_image_input(raw: RawRequest, settings: RuntimeSettings, *, field_name: str = "image",
                     max_side: int | None = None, extra_image_fields: tuple[str, ...] = ()) -> ImageInput:
    limits = decode_limits(settings)
    ctype = raw.content_type
    if ctype.startswith("image/"):
        return ImageInput(decode_image(raw.body, limits, max_side), as_text(raw.query))
    if ctype == "application/json":
        doc = parse_json_object(raw.body, settings.max_json_depth, settings.max_fields)
        if field_name not in doc:
            raise ApiError(422, "invalid_parameter", f"{field_name}: field required")
        data = decode_base64(doc.pop(field_name), field_name, settings.max_body_bytes)
        extra = {k: decode_base64(doc.pop(k), k, settings.max_body_bytes)
                 for k in extra_image_fields if doc.get(k) is not None}
        for k in extra_image_fields:
            doc.pop(k, None)
        return ImageInput(decode_image(data, limits, max_side), merge(raw.query, doc), extra)
    if ctype == "multipart/form-data":
        parts = parse_multipart(raw.body, raw.content_type_header, settings.max_fields)
        part = parts.get(field_name)
        if part is None or part.filename is None and not part.content_type.startswith("image/"):
            raise ApiError(422, "invalid_parameter", f"{field_name}: expected a file field")
        extra = {k: parts[k].data for k in extra_image_fields if k in parts}
        fields = text_fields(parts, skip=(field_name, *extra_image_fields))
        return ImageInput(decode_image(part.data, limits, max_side), merge(raw.query, as_text(fields)), extra)
    raise ApiError(415, "unsupported_media_type",
                   f"content type {ctype or '(none)'!r}: send image/*, multipart/form-data or application/json")

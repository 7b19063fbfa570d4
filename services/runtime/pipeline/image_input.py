"""An image and its parameters, from any of the three input forms a route accepts.

A raw body with an ``image/*`` content type (parameters in the query string), a
multipart form (file field ``image``, other fields as text), or a JSON object
(``{"image": "<base64>", ...typed fields}``). Runs in the CPU pool, inside a decode hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.runtime.codecs.base64_text import decode_base64
from services.runtime.codecs.forms import parse_json_object, parse_multipart, text_fields
from services.runtime.codecs.images import DecodedImage, DecodeLimits, ImageHeader, decode_probed, probe_image
from services.runtime.codecs.params import Params, as_text, merge, validate
from services.runtime.errors import ApiError
from services.runtime.pipeline.raw_request import RawRequest
from services.runtime.pipeline.settings import ModelServiceSettings


def decode_limits(settings: ModelServiceSettings) -> DecodeLimits:
    return DecodeLimits(settings.max_pixels, settings.max_jpeg_scans, settings.max_image_markers)


@dataclass
class ImageInput:
    image: DecodedImage
    params: Any                  # the validated Params model, or the raw values: typed (JSON) or Text
    extra_images: dict[str, bytes] = field(default_factory=dict)  # other image fields, still encoded
    header: ImageHeader | None = None


@dataclass
class ProbedInput:
    """A request's image(s) before decoding: what the cost check sees."""
    header: ImageHeader
    params: Any
    extra_headers: dict[str, ImageHeader] = field(default_factory=dict)

    @property
    def input_pixels(self) -> int:
        return self.header.pixels + sum(h.pixels for h in self.extra_headers.values())


# a route's statement of what a probed request costs; it calls raw.cost.check (cost.py)
CostHook = Callable[[RawRequest, ProbedInput], None]


def default_cost(max_side: int | None, validated: bool) -> CostHook:
    """One item the size of the picture (reduced to max_side when the model shrinks it), a
    small JSON answer. A dry run ends here only when the parameters were validated already
    (read_image_input's `params`): a hook that validates after reading must still run."""
    def check(raw: RawRequest, probed: ProbedInput) -> None:
        h = probed.header
        scale = min(1.0, max_side / max(h.width, h.height)) if max_side else 1.0
        if raw.cost is not None:
            raw.cost.check(items=1, item_pixels=int(h.pixels * scale * scale), input_pixels=probed.input_pixels,
                           dry_run_stops_here=validated)
    return check


def read_json(raw: RawRequest, settings: ModelServiceSettings) -> dict[str, Any]:
    if raw.content_type != "application/json":
        raise ApiError(415, "unsupported_media_type",
                       f"content type {raw.content_type or '(none)'!r}: send application/json")
    return parse_json_object(raw.body, settings.max_json_depth, settings.max_fields)


def read_image_input(raw: RawRequest, settings: ModelServiceSettings, *, field_name: str = "image",
                     max_side: int | None = None, extra_image_fields: tuple[str, ...] = (),
                     params: type[Params] | None = None, cost: CostHook | None = None) -> ImageInput:
    """The picture, its parameters and any extra picture fields, from any of the three input
    forms. In this order, so that nothing is spent on a request that will be refused: the
    parameters are validated (with `params`, a Params model: ImageInput.params is then the
    model), the headers probed, the route's cost hook states the cost, and only then is a
    pixel decoded. Extra image fields are probed too, and handed on still encoded."""
    limits = decode_limits(settings)
    data, values, extra = _split(raw, settings, field_name, extra_image_fields)
    parsed = validate(params, values) if params is not None else values
    header = probe_image(data, limits)
    probed = ProbedInput(header, parsed, {k: probe_image(v, limits) for k, v in extra.items()})
    (cost or default_cost(max_side, params is not None))(raw, probed)
    return ImageInput(decode_probed(data, header, max_side), parsed, extra, header)


def _split(raw: RawRequest, settings: ModelServiceSettings, field_name: str,
           extra_image_fields: tuple[str, ...]) -> tuple[bytes, dict[str, Any], dict[str, bytes]]:
    ctype = raw.content_type
    if ctype.startswith("image/"):
        return raw.body, as_text(raw.query), {}
    if ctype == "application/json":
        doc = parse_json_object(raw.body, settings.max_json_depth, settings.max_fields)
        if field_name not in doc:
            raise ApiError(422, "invalid_parameter", f"{field_name}: field required")
        data = decode_base64(doc.pop(field_name), field_name, settings.max_body_bytes)
        extra = {k: decode_base64(doc.pop(k), k, settings.max_body_bytes)
                 for k in extra_image_fields if doc.get(k) is not None}
        for k in extra_image_fields:
            doc.pop(k, None)
        return data, merge(raw.query, doc), extra
    if ctype == "multipart/form-data":
        parts = parse_multipart(raw.body, raw.content_type_header, settings.max_fields)
        part = parts.get(field_name)
        if part is None or part.filename is None and not part.content_type.startswith("image/"):
            raise ApiError(422, "invalid_parameter", f"{field_name}: expected a file field")
        extra = {k: parts[k].data for k in extra_image_fields if k in parts}
        fields = text_fields(parts, skip=(field_name, *extra_image_fields))
        return part.data, merge(raw.query, as_text(fields)), extra
    raise ApiError(415, "unsupported_media_type",
                   f"content type {ctype or '(none)'!r}: send image/*, multipart/form-data or application/json")

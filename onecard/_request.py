"""What a route's decode and encode hooks get: one request, read and bounded, parsed lazily.

Every method runs in the runtime's CPU pool (the hooks do), never on the event loop, and
each refuses what a client sent wrong with an ``onecard.Error`` in the envelope (4xx).
A picture is probed from its header, its cost stated, and only then decoded (once).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from services.runtime.codecs.base64_text import decode_base64
from services.runtime.codecs.forms import parse_json, parse_multipart, text_fields
from services.runtime.codecs.images import (
    DecodeLimits,
    ImageHeader,
    choose_format,
    decode_probed,
    prefers_json,
    probe_image,
)
from services.runtime.codecs.json_big_strings import is_ascii
from services.runtime.codecs.params import Params, as_text, merge, validate
from services.runtime.errors import ApiError
from services.runtime.pipeline.raw_request import RawRequest
from services.runtime.pipeline.settings import ModelServiceSettings

_NO_LIMIT = 10**9
# bodies from this size on charge what parsing copies out of them (smaller: noise)
COPIES_CHARGED_FROM = 1 << 20


class Request:
    """One request, as a route's hooks see it.

    ``state`` is a namespace the decode hook may fill for the encode hook (the same object
    reaches both). ``dry_run`` is True for ``X-Onecard-Dry-Run: 1``: the runtime stops the
    decode hook at its cost statement (``cost()``, or the one ``image()`` makes) and answers
    ``{"valid": true, ...}`` without running the model.
    """

    def __init__(self, raw: RawRequest, settings: ModelServiceSettings, image_fields: tuple[str, ...] = ("image",),
                 params: type[Params] | None = None):
        self._raw = raw
        self._settings = settings
        self._image_fields = image_fields
        self._params_model = params
        self._limits = DecodeLimits(settings.max_pixels, settings.max_jpeg_scans, settings.max_image_markers)
        self._json: Any = None
        self._form: dict | None = None
        self._pictures: dict[str, bytes] | None = None
        self._fields: dict[str, Any] | None = None
        self._headers: dict[str, ImageHeader] = {}
        self._params_read = False
        self.state = types.SimpleNamespace()

    # ---- what arrived --------------------------------------------------------------------
    @property
    def method(self) -> str:
        return self._raw.method

    @property
    def path(self) -> str:
        return self._raw.path

    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names; a repeated header keeps its last value."""
        return self._raw.headers

    @property
    def query(self) -> dict[str, str]:
        """The query string (a name given twice is a 422 already)."""
        return self._raw.query

    @property
    def content_type(self) -> str:
        """The media type alone, lower-case ("application/json")."""
        return self._raw.content_type

    @property
    def body(self) -> bytes:
        return self._raw.body

    @property
    def dry_run(self) -> bool:
        cost = self._raw.cost
        return bool(cost is not None and cost.dry_run)

    # ---- bodies that are not pictures ------------------------------------------------------
    def json(self) -> Any:
        """The JSON body (415 for another content type; 400 for bad or too deeply nested JSON;
        422 for a number that is not finite or an object with more than max_fields keys)."""
        if self._json is None:
            if self.content_type != "application/json":
                raise ApiError(415, "unsupported_media_type",
                               f"content type {self.content_type or '(none)'!r}: send application/json")
            body = self._raw.body
            cost = self._raw.cost
            if cost is not None and len(body) >= COPIES_CHARGED_FROM:
                # its strings (1 byte a character, up to 4 when one is not ASCII) and the
                # pictures their base64 decodes to (3/4 of it at most)
                ascii_only = is_ascii(body)
                cost.hold_body_copies(len(body) * (1 if ascii_only else 4) + len(body) * 3 // 4)
            doc = parse_json(body, self._settings.max_json_depth)
            if isinstance(doc, dict) and len(doc) > self._settings.max_fields:
                raise ApiError(422, "invalid_parameter", f"body: more than {self._settings.max_fields} fields")
            self._json = doc
        return self._json

    def text(self) -> str:
        """A text/plain body (415 for another content type, 400 when it is not UTF-8)."""
        if not self.content_type.startswith("text/"):
            raise ApiError(415, "unsupported_media_type",
                           f"content type {self.content_type or '(none)'!r}: send text/plain")
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "bad_text", "the body is not UTF-8 text") from None

    def params(self, model: type[Params] | None = None) -> Any:
        """The parameters, validated by ``model`` (default: the route's): from the query string
        and the form's text fields or the JSON body's fields (the picture fields left out). A
        field given both in the query string and in the body is a 422."""
        model = model or self._params_model
        if model is None:
            raise TypeError("no parameter model: pass one, or declare the route's (Model.Params)")
        self._split()
        value = validate(model, self._fields)
        self._params_read = True
        return value

    # ---- pictures ----------------------------------------------------------------------------
    def image_header(self, field: str | None = None, *, required: bool = True) -> ImageHeader | None:
        """Format and size of a picture field from its header alone (nothing decoded); None for
        an absent optional field. 413 for a picture over max_pixels or a decode bomb."""
        field = field or self._main_field()
        if field not in self._headers:
            data = self._picture(field, required)
            if data is None:
                return None
            self._headers[field] = probe_image(data, self._limits)
        return self._headers[field]

    def image(self, field: str | None = None, *, max_side: int | None = None,
              required: bool = True, answer_bytes: int | None = None) -> np.ndarray | None:
        """A picture field decoded once, as an RGB array (height x width x 3, uint8, EXIF
        orientation applied); None for an absent optional field. With ``max_side`` a JPEG
        may be decoded at reduced scale, never below max_side on its long side: resize the
        rest of the way yourself (``image_header()`` has the picture's full size).

        When the hook has stated no cost yet (``cost()``), this states the default one
        first: one item of the picture's pixels (at max_side), the pictures decoded, and an
        answer of ``answer_bytes`` at most (unsaid: a small JSON answer is counted, and a dry run
        says ``output_bytes: null``, so that a job reserves result_reserve_bytes for it). In a
        dry run that ends the hook here, once the parameters were read."""
        header = self.image_header(field, required=required)
        if header is None:
            return None
        cost = self._raw.cost
        if cost is not None and cost.estimate is None:
            scale = min(1.0, max_side / max(header.width, header.height)) if max_side else 1.0
            inputs = sum(h.decode_pixels for h in self._probe_all())
            cost.check(items=1, item_pixels=int(header.pixels * scale * scale), input_pixels=inputs,
                       output_bytes=answer_bytes, dry_run_stops_here=self._params_read)
        return decode_probed(self._picture(field or self._main_field(), True), header, max_side).rgb

    def cost(self, *, items: int = 1, item_pixels: int | list[int] = 0, input_pixels: int = 0,
             output_pixels: int = 0, output_bytes: int | None = None, base64_output: bool = False,
             answer_format: str | None = None, encoded_pixels: int | None = None) -> None:
        """State what this request will cost before decoding anything: its items, the pixels
        the model sees per item (one figure, or one per item), the pixels decoded and
        produced, the answer's size (default: from output_pixels, base64 in JSON when
        base64_output), the format its pictures are encoded in (``answer_format``: the
        encoder's own memory, PNG's when not said, for the largest picture: ``encoded_pixels``,
        else output_pixels over the items). Each product is checked against the
        service's budgets: 413 for what could never run, 503 with Retry-After for what does not
        fit now. In a dry run the hook ends here. May be called again with larger figures as the hook learns more."""
        if self._raw.cost is not None:
            self._raw.cost.check(items=items, item_pixels=item_pixels, input_pixels=input_pixels,
                                 output_pixels=output_pixels, output_bytes=output_bytes, base64_output=base64_output,
                                 answer_format=answer_format, encoded_pixels=encoded_pixels)

    def probe_image(self, data: bytes, name: str | None = None, *, for_decoding: bool = True) -> ImageHeader:
        """The header of a picture found elsewhere in the request (a custom JSON field), within
        the service's limits. ``for_decoding=False`` for a picture whose metadata alone is
        read: the pixel and scan limits do not apply then (the structure's size still does)."""
        limits = self._limits if for_decoding else DecodeLimits(_NO_LIMIT, _NO_LIMIT, self._limits.max_image_markers)
        try:
            return probe_image(data, limits)
        except ApiError as exc:
            if name:
                exc.message = f"{name}: {exc.message}"
                exc.args = (exc.message,)
            raise

    def decode_image(self, data: bytes, header: ImageHeader | None = None, *, max_side: int | None = None,
                     name: str | None = None) -> np.ndarray:
        """Decode a picture probed with ``probe_image`` (probed now when no header is given)."""
        header = header or self.probe_image(data, name)
        return decode_probed(data, header, max_side).rgb

    def answer_format(self, asked: str | None = None, default: str = "png") -> str:
        """The picture format to answer in: the one asked for, else the first image type the
        client's Accept names, else ``default``."""
        return choose_format(asked, self.headers.get("accept", ""), default)

    def wants_json(self) -> bool:
        """Whether the client's Accept wants application/json before any picture (q-values
        and their order weighed)."""
        return prefers_json(self.headers.get("accept", ""))

    # ---- the input forms ------------------------------------------------------------------------
    def _main_field(self) -> str:
        return self._image_fields[0] if self._image_fields else "image"

    def _picture(self, field: str, required: bool) -> bytes | None:
        self._split()
        data = self._pictures.get(field)
        if data is None and required:
            raise ApiError(422, "invalid_parameter", f"{field}: field required")
        return data

    def _probe_all(self) -> list[ImageHeader]:
        for field in self._pictures:
            self.image_header(field)
        return list(self._headers.values())

    def _split(self) -> None:
        """The pictures (still encoded) and the other fields, from a raw image body (fields in
        the query string), a multipart form, or a JSON object with base64 pictures. The first
        picture field is required; the others are optional."""
        if self._pictures is not None:
            return
        ctype, query, settings = self.content_type, self.query, self._settings
        fields = self._image_fields
        main = fields[0] if fields else None
        if ctype.startswith("image/") and main:
            self._pictures, self._fields = {main: self.body}, as_text(query)
        elif ctype == "application/json":
            doc = self.json()
            if not isinstance(doc, dict):
                raise ApiError(422, "invalid_parameter", "body: expected a JSON object")
            doc = dict(doc)
            pictures = {}
            if main:
                if main not in doc:
                    raise ApiError(422, "invalid_parameter", f"{main}: field required")
                pictures[main] = decode_base64(doc.pop(main), main, settings.max_body_bytes)
            for name in fields[1:]:
                value = doc.pop(name, None)
                if value is not None:
                    pictures[name] = decode_base64(value, name, settings.max_body_bytes)
            self._pictures, self._fields = pictures, merge(query, doc)
        elif ctype == "multipart/form-data":
            if self._raw.cost is not None and len(self._raw.body) >= COPIES_CHARGED_FROM:
                self._raw.cost.hold_body_copies(len(self._raw.body))  # the parts, copied out of it
            parts = parse_multipart(self._raw.body, self._raw.content_type_header, settings.max_fields)
            pictures = {}
            if main:
                part = parts.get(main)
                if part is None or part.filename is None and not part.content_type.startswith("image/"):
                    raise ApiError(422, "invalid_parameter", f"{main}: expected a file field")
                pictures[main] = part.data
            pictures.update({name: parts[name].data for name in fields[1:] if name in parts})
            self._pictures = pictures
            self._fields = merge(query, as_text(text_fields(parts, skip=fields)))
        elif not main:  # a service without pictures: the body is its hook's (text()), the query its fields
            self._pictures, self._fields = {}, as_text(query)
        else:
            raise ApiError(415, "unsupported_media_type",
                           f"content type {ctype or '(none)'!r}: send image/*, multipart/form-data or "
                           f"application/json")

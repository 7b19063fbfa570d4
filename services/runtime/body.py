"""Request bodies: read within limits on the event loop, parsed in the CPU executor.

Reading only moves bytes (413 as soon as the size is known to be over the limit,
declared or chunked). Parsing is CPU work and runs off the loop: JSON with a nesting
limit and finite numbers only, multipart in memory (no temporary files: nothing a
request sends reaches the filesystem).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from services.runtime.errors import ApiError


@dataclass
class Part:
    name: str
    data: bytes
    filename: str | None = None
    content_type: str = ""


@dataclass
class RawRequest:
    """What a route's decode hook sees: everything read, nothing parsed."""
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]          # lower-case names; a repeated header keeps its last value
    content_type: str                # media type only, lower-case
    content_type_header: str
    body: bytes = b""
    extra: dict[str, Any] = field(default_factory=dict)  # what a route passes to its hooks


def media_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


def query_params(request: Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in request.query_params.multi_items():
        if k in out:
            raise ApiError(422, "invalid_parameter", f"{k}: given more than once in the query string")
        out[k] = v
    return out


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "bad_request", "invalid Content-Length")
        if int(declared) > max_bytes:
            raise ApiError(413, "body_too_large", f"body of {declared} bytes is over the limit of {max_bytes}")
    buf = bytearray()
    async for chunk in request.stream():
        if len(buf) + len(chunk) > max_bytes:
            raise ApiError(413, "body_too_large", f"body is over the limit of {max_bytes} bytes")
        buf += chunk
    return bytes(buf)


# ---- JSON ---------------------------------------------------------------------------
_STRUCTURE = re.compile(rb'[\[\]{}"\\]')


def json_depth_over(body: bytes, max_depth: int) -> bool:
    """True when arrays/objects nest deeper than max_depth. Brackets inside strings do
    not count. Cheap for real bodies: skipped when there are too few brackets to matter,
    else one regex pass over the structural characters only."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    depth, in_string, skip = 0, False, -1
    for m in _STRUCTURE.finditer(body):
        pos = m.start()
        if pos == skip:
            continue
        c = body[pos]
        if in_string:
            if c == 0x5C:      # backslash: the next character is escaped
                skip = pos + 1
            elif c == 0x22:    # closing quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > max_depth:
                return True
        elif c in (0x5D, 0x7D):
            depth -= 1
    return False


class _NotFinite(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotFinite(text)
    return value


def parse_json(body: bytes, max_depth: int) -> Any:
    """A JSON document; 400 when it is not JSON or nests too deep, 422 for a number
    that is not finite (NaN, Infinity, 1e999)."""
    if json_depth_over(body, max_depth):
        raise ApiError(400, "json_too_deep", f"the JSON body nests deeper than {max_depth} levels")
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except _NotFinite as exc:
        raise ApiError(422, "invalid_parameter", f"JSON numbers must be finite, got {str(exc)[:40]}") from None
    except RecursionError:
        raise ApiError(400, "json_too_deep", f"the JSON body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "bad_json", "the body is not valid JSON") from None


def parse_json_object(body: bytes, max_depth: int, max_fields: int) -> dict[str, Any]:
    doc = parse_json(body, max_depth)
    if not isinstance(doc, dict):
        raise ApiError(422, "invalid_parameter", "body: expected a JSON object")
    if len(doc) > max_fields:
        raise ApiError(422, "invalid_parameter", f"body: more than {max_fields} fields")
    return doc


# ---- multipart ----------------------------------------------------------------------
def parse_multipart(body: bytes, content_type_header: str, max_fields: int) -> dict[str, Part]:
    """Every part in memory, by field name; a repeated name or too many parts is a 422."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, options = parse_options_header(content_type_header)
    boundary = options.get(b"boundary")
    if not boundary:
        raise ApiError(400, "bad_multipart", "multipart/form-data without a boundary")
    parts: list[Part] = []
    state: dict[str, Any] = {"headers": {}, "field": b"", "value": b"", "data": []}

    def on_part_begin() -> None:
        if len(parts) >= max_fields:
            raise ApiError(422, "invalid_parameter", f"more than {max_fields} multipart parts")
        state["headers"], state["data"] = {}, []

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].decode("latin-1").lower()] = state["value"].decode("latin-1")
        state["field"], state["value"] = b"", b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        state["data"].append(data[start:end])

    def on_part_end() -> None:
        _, disp = parse_options_header(state["headers"].get("content-disposition", ""))
        name = disp.get(b"name")
        if name is None:
            raise ApiError(400, "bad_multipart", "a multipart part has no field name")
        filename = disp.get(b"filename")
        parts.append(Part(name.decode("utf-8", "replace"), b"".join(state["data"]),
                          None if filename is None else filename.decode("utf-8", "replace"),
                          media_type(state["headers"].get("content-type", ""))))

    callbacks = {"on_part_begin": on_part_begin, "on_header_field": on_header_field,
                 "on_header_value": on_header_value, "on_header_end": on_header_end,
                 "on_part_data": on_part_data, "on_part_end": on_part_end}
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except ApiError:
        raise
    except (FormParserError, ValueError) as exc:
        raise ApiError(400, "bad_multipart", f"cannot parse the multipart body: {exc}") from None
    out: dict[str, Part] = {}
    for part in parts:
        if part.name in out:
            raise ApiError(422, "invalid_parameter", f"{part.name}: given more than once")
        out[part.name] = part
    return out


def text_fields(parts: dict[str, Part], skip: tuple[str, ...]) -> dict[str, str]:
    """The plain (non-file) fields of a form, as text."""
    out = {}
    for name, part in parts.items():
        if name in skip:
            continue
        if part.filename is not None:
            raise ApiError(422, "invalid_parameter", f"{name}: expected a text field, got a file")
        try:
            out[name] = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(422, "invalid_parameter", f"{name}: not UTF-8 text") from None
    return out

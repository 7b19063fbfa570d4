"""Request bodies parsed: JSON with a nesting limit and finite numbers only, multipart in
memory (no temporary files: nothing a request sends reaches the filesystem). CPU work:
the runtime runs it in its executor, never on the event loop."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.runtime.codecs import json_big_strings
from services.runtime.codecs.fresh_bytes import joined
from services.runtime.codecs.gil_lane import lane
from services.runtime.errors import ApiError


def media_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


@dataclass
class Part:
    name: str
    data: bytes
    filename: str | None = None
    content_type: str = ""


# ---- JSON ---------------------------------------------------------------------------
def json_depth_over(doc: Any, max_depth: int) -> bool:
    """True when arrays/objects in a parsed document nest deeper than max_depth. Level by
    level, stopping at max_depth: at most one visit per container, so the cost is bounded
    by what json.loads already spent (brackets inside strings are just characters)."""
    level = [doc] if isinstance(doc, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        nxt = []
        for node in level:
            values = node.values() if isinstance(node, dict) else node
            nxt.extend(v for v in values if isinstance(v, (dict, list)))
        level = nxt
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
    that is not finite (NaN, Infinity, 1e999). json.loads itself stops at about 1000
    levels (RecursionError); the walk afterwards enforces max_depth."""
    try:
        doc = json_big_strings.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except _NotFinite as exc:
        raise ApiError(422, "invalid_parameter", f"JSON numbers must be finite, got {str(exc)[:40]}") from None
    except RecursionError:
        raise ApiError(400, "json_too_deep", f"the JSON body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        # an integer of more digits than int() reads is valid JSON (a parse_int hook to tell
        # it apart made every integer a Python call: 2.5 times the parse, the GIL held)
        if not isinstance(exc, json.JSONDecodeError) and "integer string conversion" in str(exc):
            raise ApiError(422, "invalid_parameter", "a JSON number has over 4300 digits: out of range") from None
        raise ApiError(400, "bad_json", "the body is not valid JSON") from None
    if json_depth_over(doc, max_depth):
        raise ApiError(400, "json_too_deep", f"the JSON body nests deeper than {max_depth} levels")
    return doc


def parse_json_object(body: bytes, max_depth: int, max_fields: int) -> dict[str, Any]:
    doc = parse_json(body, max_depth)
    if not isinstance(doc, dict):
        raise ApiError(422, "invalid_parameter", "body: expected a JSON object")
    if len(doc) > max_fields:
        raise ApiError(422, "invalid_parameter", f"body: more than {max_fields} fields")
    return doc


# ---- multipart ----------------------------------------------------------------------
MULTIPART_SLICE = 1 << 20


def parse_multipart(body: bytes, content_type_header: str, max_fields: int) -> dict[str, Part]:
    """Every part in memory, by field name; a repeated name or too many parts is a 422."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

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
        parts.append(Part(name.decode("utf-8", "replace"), state["data"],  # joined below
                          None if filename is None else filename.decode("utf-8", "replace"),
                          media_type(state["headers"].get("content-type", ""))))

    callbacks = {"on_part_begin": on_part_begin, "on_header_field": on_header_field,
                 "on_header_value": on_header_value, "on_header_end": on_header_end,
                 "on_part_data": on_part_data, "on_part_end": on_part_end}
    try:
        parser = MultipartParser(boundary, callbacks)
        for i in range(0, len(body), MULTIPART_SLICE):  # slices, each in the GIL lane
            with lane():
                parser.write(body[i:i + MULTIPART_SLICE])
        parser.finalize()
    except ApiError:
        raise
    except (FormParserError, ValueError) as exc:
        raise ApiError(400, "bad_multipart", f"cannot parse the multipart body: {exc}") from None
    if parser.state != MultipartState.END:  # cut short: its last part may be a piece of a picture
        raise ApiError(400, "bad_multipart", "the multipart body ends before its closing boundary")
    out: dict[str, Part] = {}
    for part in parts:
        part.data = _joined(part.data)
        if part.name in out:
            raise ApiError(422, "invalid_parameter", f"{part.name}: given more than once")
        out[part.name] = part
    return out


def _joined(pieces: list[bytes]) -> bytes:
    """A part's pieces (a slice of the body at most each) as one object: no join of
    megabytes with the GIL held."""
    if len(pieces) <= 1:
        return pieces[0] if pieces else b""
    return joined(pieces, sum(map(len, pieces)))


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

"""base64 in and out of JSON answers and bodies, in slices so that a big picture never holds
the GIL (and with it the event loop and the probes) for long."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from services.runtime.codecs.fresh_bytes import FreshAscii, FreshBytes
from services.runtime.codecs.gil_lane import in_lane, lane
from services.runtime.errors import ApiError

B64_CHUNK = 3 << 16      # base64 work in 192 kB slices: each holds the GIL for a fraction of a millisecond

_WHITESPACE = str.maketrans("", "", " \t\r\n")


def _has_whitespace(text: str) -> bool:
    """A substring test in slices: each a short hold of the GIL, in the lane."""
    for i in range(0, len(text), B64_CHUNK):
        if in_lane(min(B64_CHUNK, len(text) - i), _whitespace_in, text, i, i + B64_CHUNK):
            return True
    return False


def _whitespace_in(text: str, start: int, end: int) -> bool:
    return any(text.find(c, start, end) >= 0 for c in " \t\r\n")


def decode_base64(text: Any, name: str, max_bytes: int | None = None) -> bytes:
    """A base64 field (a data: URL prefix and MIME line breaks are allowed, as webui clients
    send them); 422 when not a string, 400 when garbled. Decoded in slices, each in the GIL
    lane, into the bytes object it returns (no join), so that a big field never holds the
    GIL (and with it the event loop) for long."""
    if not isinstance(text, str):
        raise ApiError(422, "invalid_parameter", f"{name}: expected a base64 string")
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if max_bytes is not None and len(text) * 3 // 4 > max_bytes + 3 * (len(text) // 76 + 1):
        raise ApiError(413, "body_too_large", f"{name}: over the limit of {max_bytes} bytes")
    if _has_whitespace(text):
        text = "".join(in_lane(B64_CHUNK, text[i:i + B64_CHUNK].translate, _WHITESPACE)
                       for i in range(0, len(text), B64_CHUNK))
    if max_bytes is not None and len(text) * 3 // 4 > max_bytes:
        raise ApiError(413, "body_too_large", f"{name}: over the limit of {max_bytes} bytes")
    if len(text) % 4:
        raise ApiError(400, "bad_base64", f"{name}: not valid base64")
    step = B64_CHUNK // 3 * 4
    try:
        if len(text) <= step:
            return in_lane(len(text), binascii.a2b_base64, text, strict_mode=True) if text else b""
        size = len(text) // 4 * 3 - (2 if text.endswith("==") else 1 if text.endswith("=") else 0)
        out = FreshBytes(size)
        for i in range(0, len(text), step):
            with lane():
                out.write(binascii.a2b_base64(text[i:i + step], strict_mode=True))
        return out.take()
    except (binascii.Error, ValueError):
        raise ApiError(400, "bad_base64", f"{name}: not valid base64") from None


# base64 text we produced. Once a str subclass that JSON answers spliced in unscanned; they
# now splice every big string a slice at a time (services.runtime.codecs.json_answer), and a
# subclass cost one more copy of the whole text to make, with the GIL held.
Base64Text = str


def encode_base64(data: bytes) -> Base64Text:
    """base64 text of `data`, in slices, each in the GIL lane, written into the string it
    returns (see decode_base64)."""
    if len(data) <= B64_CHUNK:
        return in_lane(len(data), base64.b64encode, data).decode("ascii")
    view = memoryview(data).cast("B")
    out = FreshAscii((len(data) + 2) // 3 * 4)
    for i in range(0, len(data), B64_CHUNK):
        with lane():
            out.write(base64.b64encode(view[i:i + B64_CHUNK]))
    return out.take()

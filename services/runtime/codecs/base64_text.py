"""base64 in and out of JSON answers and bodies, without holding the GIL (and with it the
event loop and the probes) for long.

pybase64 (libbase64, SIMD) releases the GIL for the whole conversion and is 25x quicker than
binascii (15 MB: 1 ms against 28 ms, all of it with the GIL held); binascii is left for the
line-broken text that strict decoding refuses, and that is first stripped in slices."""

from __future__ import annotations

import binascii
from typing import Any

import pybase64

from services.runtime.codecs.fresh_bytes import FreshAscii
from services.runtime.codecs.gil_lane import in_lane
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
    send them); 422 when not a string, 400 when garbled (strictly: padding only at the end,
    nothing outside the alphabet but those line breaks)."""
    if not isinstance(text, str):
        raise ApiError(422, "invalid_parameter", f"{name}: expected a base64 string")
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if max_bytes is not None and len(text) * 3 // 4 > max_bytes + 3 * (len(text) // 76 + 1):
        raise ApiError(413, "body_too_large", f"{name}: over the limit of {max_bytes} bytes")
    if len(text) % 4 == 0 and (max_bytes is None or len(text) * 3 // 4 <= max_bytes):
        try:
            return pybase64.b64decode(text, validate=True)  # the common case: no line breaks
        except (binascii.Error, ValueError, TypeError):
            pass
    if _has_whitespace(text):
        text = "".join(in_lane(B64_CHUNK, text[i:i + B64_CHUNK].translate, _WHITESPACE)
                       for i in range(0, len(text), B64_CHUNK))
    if max_bytes is not None and len(text) * 3 // 4 > max_bytes:
        raise ApiError(413, "body_too_large", f"{name}: over the limit of {max_bytes} bytes")
    if len(text) % 4:
        raise ApiError(400, "bad_base64", f"{name}: not valid base64")
    try:
        return pybase64.b64decode(text, validate=True)  # the GIL released for the whole decode
    except (binascii.Error, ValueError, TypeError):
        raise ApiError(400, "bad_base64", f"{name}: not valid base64") from None


# base64 text we produced. Once a str subclass that JSON answers spliced in unscanned; they
# now splice every big string a slice at a time (services.runtime.codecs.json_answer), and a
# subclass cost one more copy of the whole text to make, with the GIL held.
Base64Text = str


def encode_base64(data: bytes) -> Base64Text:
    """base64 text of `data`, written a slice at a time into the string it returns (no copy
    of the whole text with the GIL held); the encoding and the copies release the GIL."""
    if len(data) <= B64_CHUNK:
        return pybase64.b64encode(data).decode("ascii")
    view = memoryview(data).cast("B")
    out = FreshAscii((len(data) + 2) // 3 * 4)
    for i in range(0, len(data), B64_CHUNK):
        out.write(pybase64.b64encode(view[i:i + B64_CHUNK]))
    return out.take()

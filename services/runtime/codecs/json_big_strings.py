"""JSON bodies that carry pictures as base64 strings, parsed without one long hold of the GIL.

``json.loads`` scans a 20 MB document in one call: 8 ms warm, several times that with cold
pages and two busy cores, and the event loop (with the probes) waits for all of it. Here the
big base64 strings are found first with byte searches (each a short call, in the GIL lane),
cut out of the document, and put back into the parsed result; json.loads only sees what is
left, a few hundred bytes. A string is cut out only when the result is certain to be what
json.loads gives: at least ``BIG_STRING`` long, no backslash, valid base64 after an optional
``data:...,`` prefix (checked by libbase64, which releases the GIL), and a value (not a
key). Anything else (escapes, keys, a document that is not JSON, one in UTF-16 or UTF-32)
goes to json.loads as it is, which then answers as it always did.
"""

from __future__ import annotations

import binascii
import json
import secrets
from typing import Any

import numpy as np
import pybase64

from services.runtime.codecs.fresh_bytes import FreshAscii
from services.runtime.codecs.gil_lane import in_lane

BIG_STRING = 64 * 1024
SCAN_SLICE = 1 << 18
MAX_BACKSLASH_RUN = 64      # a longer run before a quote: not worth working out, json.loads it
_WHITESPACE = b" \t\r\n"


def _base64_text(data: memoryview) -> str | None:
    """The string json.loads would give for these bytes when they are base64 (after an
    optional data: URL prefix), built a slice at a time; else None."""
    head = bytes(data[:256])
    start = 0
    if head.startswith(b"data:"):
        comma = head.find(b",")
        if comma < 0 or not head[:comma].isascii() or any(b < 0x20 for b in head[:comma]):
            return None
        start = comma + 1
    if (len(data) - start) % 4:
        return None
    out = FreshAscii(len(data))
    out.write(data[:start])
    for i in range(start, len(data), SCAN_SLICE):
        piece = data[i:i + SCAN_SLICE]
        try:  # base64 or not, checked by decoding it: libbase64 releases the GIL (translate did not)
            pybase64.b64decode(piece, validate=True)
        except (binascii.Error, ValueError):
            return None
        out.write(piece)  # a copy that releases the GIL (fresh_bytes)
    return out.take()


def is_ascii(data: bytes) -> bool:
    """``data.isascii()`` with the GIL released: a numpy reduction (0.7 ms of GIL held for a
    20 MB body the other way, far longer with its pages cold and the cores busy)."""
    return len(data) == 0 or int(np.frombuffer(data, np.uint8).max()) < 0x80


FIND_SLICE = 1 << 20


def _find(body: bytes, byte: bytes, start: int, end: int | None = None) -> int:
    """body.find(byte, start, end) for one byte, a slice at a time: one search through a 20 MB
    string held the GIL (and with it the event loop) for milliseconds at a time."""
    end = len(body) if end is None else min(end, len(body))
    while start < end:
        stop = min(end, start + FIND_SLICE)
        found = in_lane(stop - start, body.find, byte, start, stop)
        if found >= 0:
            return found
        start = stop
    return -1


def _string_end(body: bytes, start: int, quotes_left: list[int]) -> int:
    """The index of the quote that closes the string opened at `start - 1`; -1 when not found
    (or not worth finding)."""
    j = start
    while True:
        quotes_left[0] -= 1
        if quotes_left[0] < 0:
            return -1
        e = _find(body, b'"', j)
        if e < 0:
            return -1
        before = bytes(body[max(start, e - MAX_BACKSLASH_RUN):e])
        run = len(before) - len(before.rstrip(b"\\"))  # the backslashes just before it, counted in C
        if run >= MAX_BACKSLASH_RUN:
            return -1
        if run % 2 == 0:
            return e
        j = e + 1


def _is_key(body: bytes, end: int) -> bool:
    """Whether the string that ends at `end` is an object's key (whitespace, then a colon):
    the whitespace skipped in C, a slice at a time (megabytes of it are allowed)."""
    i = end + 1
    while i < len(body):
        rest = body[i:i + SCAN_SLICE].lstrip(_WHITESPACE)
        if rest:
            return rest[0] == 0x3A  # ':'
        i += SCAN_SLICE
    return False


def split_big_strings(body: bytes, max_strings: int) -> tuple[bytes, dict[str, str]] | None:
    """(the document with each big base64 string replaced by a unique placeholder, the strings
    by placeholder), or None when there is none to cut out (or the scan gave up)."""
    view = memoryview(body)
    token = secrets.token_hex(8)
    pieces: list[bytes] = []
    bigs: dict[str, str] = {}
    quotes_left = [2 * max_strings + 2]
    i = done = 0
    while True:
        q = _find(body, b'"', i)
        if q < 0:
            break
        e = _string_end(body, q + 1, quotes_left)
        if e < 0:
            return None
        if e - q - 1 >= BIG_STRING and _find(body, b"\\", q + 1, e) < 0 and not _is_key(body, e):
            text = _base64_text(view[q + 1:e])
            if text is not None:
                name = f"\u0000onecard:{token}:{len(bigs)}"
                pieces.append(bytes(view[done:q]))
                pieces.append(json.dumps(name).encode())
                bigs[name] = text
                done = e + 1
        i = e + 1
    if not bigs:
        return None
    pieces.append(bytes(view[done:]))
    return b"".join(pieces), bigs


def _put_back(doc: Any, bigs: dict[str, str]) -> Any:
    if isinstance(doc, str):
        return bigs.get(doc, doc)
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, str):
                if value in bigs:
                    node[key] = bigs[value]
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return doc


MAX_STRINGS = 20_000        # strings scanned before the big ones; past that, json.loads it all


def _is_utf8(body: bytes) -> bool:
    """Whether json.loads reads these bytes as UTF-8. It reads UTF-16 and UTF-32 too (told by
    the zero bytes of the first four): there a quote byte and base64 bytes can be halves of
    other characters, and an ASCII placeholder spliced in would be read as garbage."""
    return json.detect_encoding(body[:4]) in ("utf-8", "utf-8-sig")


def loads(body: bytes, max_strings: int = MAX_STRINGS, **kwargs: Any) -> Any:
    """json.loads(body, **kwargs), with the big base64 strings cut out first (see above)."""
    split = split_big_strings(body, max_strings) if len(body) >= BIG_STRING and _is_utf8(body) else None
    if split is None:
        return in_lane(len(body), json.loads, body, **kwargs)
    skeleton, texts = split
    return _put_back(in_lane(len(skeleton), json.loads, skeleton, **kwargs), texts)

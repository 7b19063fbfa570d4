"""JSON answers as byte strings, big strings a slice at a time.

Big strings (base64 pictures, mostly) are spliced into the document rather than scanned by
json.dumps: 27 MB of base64 took json.dumps 40 ms with the GIL held, which stalled the
event loop and the probes. Each slice is checked (and escaped, when it needs it: JSON
escapes a character at a time, so a slice escapes as it would inside the whole) in the GIL
lane, and the answer is sent as its parts, never joined into one more copy.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

from services.runtime.codecs.gil_lane import lane

SPLICE_OVER = 64 * 1024
SPLICE_STEP = 1 << 20


def json_parts(doc: Any) -> list[bytes]:
    """Compact JSON, as a list of byte strings to send one after the other."""
    big: list[str] = []
    mark = f"onecard-splice-{secrets.token_hex(8)}-"  # no caller's string can hold it
    skeleton = json.dumps(_swap(doc, big, mark), separators=(",", ":"), allow_nan=False)
    if not big:
        return [skeleton.encode()]
    pieces = skeleton.split(mark)
    parts = [pieces[0].encode()]
    for piece in pieces[1:]:
        index, _, rest = piece.partition('"')
        text = big[int(index)]
        for i in range(0, len(text), SPLICE_STEP):
            with lane():
                parts.append(_json_text(text[i:i + SPLICE_STEP]))
        parts += [b'"', rest.encode()]
    return parts


def _swap(node: Any, big: list[str], mark: str) -> Any:
    """The document with each big string replaced by a numbered mark (the string put in `big`).
    A module function, not a closure: a closure that calls itself is a reference cycle, and it
    kept every answer's base64 pictures until a full collection (four 40 MP extras answers:
    +130 MiB of img2img each time, with the collector tuned to run rarely)."""
    if isinstance(node, str) and len(node) > SPLICE_OVER:
        big.append(node)
        return f"{mark}{len(big) - 1}"
    if isinstance(node, float) and not math.isfinite(node):
        return None  # JSON has no NaN (json.dumps writes it, strict parsers refuse it): as JSON.stringify
    if isinstance(node, dict):
        return {_key(k): _swap(v, big, mark) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_swap(v, big, mark) for v in node]
    return node


def _key(key: Any) -> Any:
    """A non-finite number as a key is the text json.dumps always made of it ("NaN")."""
    if isinstance(key, float) and not math.isfinite(key):
        return "NaN" if key != key else ("Infinity" if key > 0 else "-Infinity")
    return key


# what json.dumps writes as it is (ensure_ascii): printable ASCII but the quote and backslash
_UNESCAPED = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')


def _json_text(piece: str) -> bytes:
    """A string's slice as it appears inside the JSON document."""
    try:
        data = piece.encode("ascii")
        if not data.translate(None, _UNESCAPED):
            return data
    except UnicodeEncodeError:
        pass
    return json.dumps(piece)[1:-1].encode("ascii")


def json_bytes(doc: Any) -> bytes:
    return b"".join(json_parts(doc))

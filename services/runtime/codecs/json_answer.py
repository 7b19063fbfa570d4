"""JSON answers as byte strings, without scanning big base64 pictures.

Big base64 strings we produced (codecs.base64_text.Base64Text) are spliced into the
document rather than scanned by json.dumps: 27 MB of base64 took json.dumps 40 ms with
the GIL held, which stalled the event loop and the probes; nor is the answer joined
into one more copy.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from services.runtime.codecs.base64_text import Base64Text

SPLICE_OVER = 64 * 1024
SPLICE_STEP = 1 << 20


def json_parts(doc: Any) -> list[bytes]:
    """Compact JSON, as a list of byte strings to send one after the other."""
    big: list[str] = []
    mark = f"onecard-splice-{secrets.token_hex(8)}-"  # no caller's string can hold it

    def swap(node: Any) -> Any:
        if isinstance(node, Base64Text) and len(node) > SPLICE_OVER:
            big.append(node)
            return f"{mark}{len(big) - 1}"
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [swap(v) for v in node]
        return node

    skeleton = json.dumps(swap(doc), separators=(",", ":"))
    if not big:
        return [skeleton.encode()]
    pieces = skeleton.split(mark)
    parts = [pieces[0].encode()]
    for piece in pieces[1:]:
        index, _, rest = piece.partition('"')
        text = big[int(index)]
        parts += [text[i:i + SPLICE_STEP].encode("ascii") for i in range(0, len(text), SPLICE_STEP)]
        parts += [b'"', rest.encode()]
    return parts


def json_bytes(doc: Any) -> bytes:
    return b"".join(json_parts(doc))

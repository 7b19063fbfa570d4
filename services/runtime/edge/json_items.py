"""How many items a JSON body holds, counted before it is parsed.

``json.loads`` builds a Python object for every container and value and holds the GIL for
the whole document: 18 MB of ``[]`` become about 460 MB of empty lists and seconds of an
event loop (and a probe thread) that does not turn. Depth and size limits do not catch it;
the number of items does. Every array, object and further element costs one ``[``, ``{``
or ``,`` byte, so counting those bytes bounds the items from above before anything is
built. ``bytes.count`` runs at memory speed in C (a few milliseconds for 20 MB, and
the body is counted a piece at a time as it arrives), so the count itself never holds
the loop for long.

Characters inside strings are counted too (a prompt's commas): the count is an upper
bound, and the default limit leaves room for that (a webui request with 64 pictures and
a long prompt holds a few hundred).
"""

from __future__ import annotations

import itertools
import re

from services.runtime.errors import ApiError

# A string, or one left open at the end of what arrived: every match attempt from a quote
# succeeds and consumes up to where it stopped, so the scan is linear (a pattern that can
# fail after scanning to the end is retried from every later quote: quadratic, seconds for
# 64 KB of \" pairs without a closing quote).
_STRING = re.compile(rb'"(?>[^"\\]*(?:\\.[^"\\]*)*)(?:"|\\?\Z)', re.DOTALL)  # DOTALL: a backslash escapes any byte
_BRACKETS_ONLY = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [1 if b in b"[{" else -1 for b in range(256)]
_AS_PARENS = bytes.maketrans(b"[{]}", b"(())")
QUICK_PASSES = 8
# How much of a body refused for its items is looked at for its depth: the scan is C
# iterators, but at the edge it runs on the event loop (about 25 ms a MiB of brackets; a MiB
# took the loop 5 to 25 ms at every refusal of a stream of `[]` bodies). A deep document is
# deep within its first bytes.
DEPTH_SCAN_MAX = 64 * 1024

# A body refused before it was read whole keeps arriving; the client is told the
# connection closes, so that it does not send its next request on it.
CLOSE = {"Connection": "close"}


def is_json_media(media_type: str) -> bool:
    """``application/json`` and the structured ``+json`` types (RFC 6839)."""
    return media_type == "application/json" or media_type.endswith("+json")


_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b"[{,")


def structural_bytes(data: bytes | bytearray | memoryview) -> int:
    """The ``[``, ``{`` and ``,`` bytes of ``data``: at least the items it can parse into.
    This runs on the event loop for every piece of every JSON body, mostly pieces of a base64
    string that hold none: three memchr searches tell that (5 us for 256 KiB) before the one
    pass that keeps only those bytes (60 us; 3x faster than three counts)."""
    if isinstance(data, memoryview):
        data = bytes(data)
    if b"," not in data and b"[" not in data and b"{" not in data:
        return 0
    return len(data.translate(None, _NOT_STRUCTURAL))


def too_complex(max_items: int) -> ApiError:
    return ApiError(413, "json_too_complex",
                    f"the JSON body holds over {max_items} items (arrays, objects and elements, counted by "
                    f"their '[', '{{' and ',' characters; max_json_items)", CLOSE)


def too_deep(max_depth: int, headers: dict[str, str] | None = None) -> ApiError:
    return ApiError(400, "json_too_deep", f"the JSON body nests deeper than {max_depth} levels", headers)


def nests_deeper_than(data: bytes | bytearray, max_depth: int) -> bool:
    """Do the arrays and objects of ``data`` (a JSON text, or the start of one; only its first
    DEPTH_SCAN_MAX bytes are looked at) nest deeper than ``max_depth``? Strings are dropped,
    the brackets kept, and the running depth (+1 for an opening bracket, -1 for a closing
    one) is summed by C iterators: 1.6 ms for 64 KB of brackets, at every refusal of a stream
    of `[][]...` bodies, on the event loop. So first the innermost pairs are peeled off, a
    pass at a time (each a C-speed replace): when a few passes leave only opening brackets,
    the depth is at most the passes plus those, and a document within that bound is shallow
    without the sum."""
    brackets = _STRING.sub(b"", bytes(data[:DEPTH_SCAN_MAX])).translate(None, _BRACKETS_ONLY)
    if not brackets:
        return False
    parens = brackets.translate(_AS_PARENS)
    for passes in range(1, QUICK_PASSES + 1):
        parens = parens.replace(b"()", b"")
        if b"()" not in parens:
            if b")" not in parens and passes + len(parens) <= max_depth:
                return False
            break
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets))) > max_depth


def check_json_items(body: bytes | bytearray, max_items: int, max_depth: int | None = None) -> None:
    """413 ``json_too_complex`` when ``body`` may hold more than ``max_items`` items; 400
    ``json_too_deep`` instead when, besides, it nests deeper than ``max_depth`` (the answer a
    deep document gets when it is small: the same class of body gets the same answer)."""
    if structural_bytes(body) > max_items:
        if max_depth is not None and nests_deeper_than(body, max_depth):  # its first MiB
            raise too_deep(max_depth)
        raise too_complex(max_items)


def _head(before: bytes | bytearray | memoryview, piece: bytes) -> bytes:
    """The first DEPTH_SCAN_MAX bytes of what arrived, copying no more than that."""
    head = bytes(before[:DEPTH_SCAN_MAX])
    return head + piece[:DEPTH_SCAN_MAX - len(head)]


class JsonItemCounter:
    """The same count over a body that arrives in pieces (a structural byte is one byte, so
    it never straddles two pieces): the body is refused at the piece that passes the limit,
    with 400 ``json_too_deep`` rather than 413 when what arrived (its first DEPTH_SCAN_MAX) nests
    deeper than ``max_depth``: a deep document gets the same answer however deep."""

    __slots__ = ("max_items", "max_depth", "count")

    def __init__(self, max_items: int, max_depth: int | None = None):
        self.max_items, self.max_depth = max_items, max_depth
        self.count = 0

    def feed(self, piece: bytes, before: bytes | bytearray = b"") -> None:
        """Count ``piece``; ``before`` is what arrived ahead of it."""
        self.count += structural_bytes(piece)
        if self.count > self.max_items:
            if self.max_depth is not None and nests_deeper_than(_head(before, piece), self.max_depth):
                raise too_deep(self.max_depth, CLOSE)
            raise too_complex(self.max_items)

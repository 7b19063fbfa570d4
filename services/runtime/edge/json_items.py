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

from services.runtime.errors import ApiError

# A body refused before it was read whole keeps arriving; the client is told the
# connection closes, so that it does not send its next request on it.
CLOSE = {"Connection": "close"}


def is_json_media(media_type: str) -> bool:
    """``application/json`` and the structured ``+json`` types (RFC 6839)."""
    return media_type == "application/json" or media_type.endswith("+json")


def structural_bytes(data: bytes | bytearray | memoryview) -> int:
    """The ``[``, ``{`` and ``,`` bytes of ``data``: at least the items it can parse into."""
    return data.count(b"[") + data.count(b"{") + data.count(b",")


def too_complex(max_items: int) -> ApiError:
    return ApiError(413, "json_too_complex",
                    f"the JSON body holds over {max_items} items (arrays, objects and elements, counted by "
                    f"their '[', '{{' and ',' characters; max_json_items)", CLOSE)


def check_json_items(body: bytes | bytearray, max_items: int) -> None:
    """413 ``json_too_complex`` when ``body`` may hold more than ``max_items`` items."""
    if structural_bytes(body) > max_items:
        raise too_complex(max_items)


class JsonItemCounter:
    """The same count over a body that arrives in pieces (a structural byte is one byte, so
    it never straddles two pieces): the body is refused at the piece that passes the limit."""

    __slots__ = ("max_items", "count")

    def __init__(self, max_items: int):
        self.max_items = max_items
        self.count = 0

    def feed(self, piece: bytes) -> None:
        self.count += structural_bytes(piece)
        if self.count > self.max_items:
            raise too_complex(self.max_items)

"""Request bodies read within limits on the event loop, and the query string.

Reading only moves bytes: 413 as soon as the size is known to be over the limit, declared
or chunked. The memory ledger is told what the body holds as its bytes arrive (with a
little headroom), not what it declares: an upload that trickles holds what it has sent,
not the 20 MB it announced. A JSON body's items are counted as it arrives (a few byte
counts per piece, services.runtime.edge.json_items), so a document that would cost far
more parsed than sent is refused before it is parsed. Parsing is CPU work and runs off
the loop (services.runtime.codecs.forms).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request

from services.runtime.codecs.copy_behind import CopyBehind
from services.runtime.codecs.fresh_bytes import FreshBytes
from services.runtime.edge.json_items import CLOSE, DEPTH_SCAN_MAX, JsonItemCounter, is_json_media
from services.runtime.errors import ApiError, ClientGone


def query_params(request: Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in request.query_params.multi_items():
        if k in out:
            raise ApiError(422, "invalid_parameter", f"{k}: given more than once in the query string")
        out[k] = v
    return out


# The ledger is raised ahead of the bytes by a quarter of what arrived (at least this much):
# a few calls for a big body, and a connection that sent little holds little.
HOLD_HEADROOM = 64 * 1024


# A body declared at least this big is written straight into the bytes object it ends up as
# (services.runtime.codecs.fresh_bytes): joining it afterwards copied 15 MB in one go with
# the GIL held, and sixteen concurrent 12 MP PNG uploads spent most of their GIL time there.
DIRECT_MIN_BYTES = 1 << 20


class BodyBuffer:
    """The body's bytes as they arrive: in place when the length is known ahead (the copies
    made off the loop, services.runtime.codecs.copy_behind), else in a bytearray copied once
    at the end."""

    def __init__(self, expected: int | None):
        self._direct: CopyBehind | None = None
        self._grown = bytearray()
        # The body's first bytes, kept apart when it goes in place: a piece still queued for
        # the copier is a hole in the object, and a JSON body refused for its items is
        # answered from its start (json_items: the depth of its first DEPTH_SCAN_MAX bytes).
        self._head = bytearray()
        if expected is not None and expected >= DIRECT_MIN_BYTES:
            try:
                self._direct = CopyBehind(FreshBytes(expected))
            except MemoryError:
                pass

    def add(self, piece: bytes) -> None:
        if self._direct is not None:
            if self.size + len(piece) > self._direct.capacity:  # (the server stops at the length anyway)
                raise ApiError(400, "bad_request", "the body is longer than its Content-Length", CLOSE)
            if len(self._head) < DEPTH_SCAN_MAX:
                self._head += piece[:DEPTH_SCAN_MAX - len(self._head)]
            self._direct.write(piece)
        else:
            self._grown += piece

    @property
    def size(self) -> int:
        return self._direct.size if self._direct is not None else len(self._grown)

    def before(self) -> bytearray:
        """What arrived so far: all of it, or (in place) at least its first DEPTH_SCAN_MAX bytes."""
        return self._head if self._direct is not None else self._grown

    async def take(self) -> bytes:
        if self._direct is None:
            return bytes(self._grown)
        try:
            return await self._direct.take()
        except ValueError:  # the server ends a body at its length: this cannot be short
            raise ApiError(400, "bad_request", "the body is shorter than its Content-Length", CLOSE) from None


def media_type_of(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def declared_length(request: Request, max_bytes: int) -> int | None:
    """The body's Content-Length (None when it has none): 400 when it is not a number, 413
    when it is over `max_bytes`, before a byte of the body is read."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.strip().isdigit():
        raise ApiError(400, "bad_request", "invalid Content-Length")
    if int(declared) > max_bytes:
        raise ApiError(413, "body_too_large", f"body of {declared} bytes is over the limit of {max_bytes}", CLOSE)
    return int(declared)


async def read_body(request: Request, max_bytes: int, hold: Callable[[int], Awaitable[None] | None] | None = None,
                    max_json_items: int | None = None, max_json_depth: int | None = None) -> bytes:
    """The whole body, within `max_bytes`. `hold(n)` is told how much is held as the body
    arrives (never more than its declared length): it raises to refuse the rest, or returns
    an awaitable to wait for room before more is read. With
    `max_json_items`, a JSON body (application/json, +json) is refused with 413
    ``json_too_complex`` at the piece that takes it past that many items (400 ``json_too_deep``
    when it nests deeper than `max_json_depth` too)."""
    declared = declared_length(request, max_bytes)
    cap = max_bytes if declared is None else declared
    items = JsonItemCounter(max_json_items, max_json_depth) if max_json_items is not None and is_json_media(
        media_type_of(request)) else None
    held = 0
    buf = BodyBuffer(declared)
    try:
        async for chunk in request.stream():
            if buf.size + len(chunk) > max_bytes:
                raise ApiError(413, "body_too_large", f"body is over the limit of {max_bytes} bytes", CLOSE)
            if items is not None:
                items.feed(chunk, buf.before())
            buf.add(chunk)
            if hold is not None and buf.size > held:
                held = max(buf.size, min(cap, buf.size + max(HOLD_HEADROOM, buf.size // 4)))
                pending = hold(held)
                if pending is not None:
                    await pending
    except ClientDisconnect:  # left mid-upload (or cut at the body deadline): nobody to answer
        raise ClientGone() from None
    return await buf.take()


async def body_begun(request: Request) -> list[dict]:
    """The messages that brought the first bytes of `request`'s body (or said it is empty),
    once they came; whoever reads the body next replays them first. A client that asked for
    `100 Continue` gets it now. For what is admitted against a shared bound before its body is
    read (jobs' submits): a client that announces a body and sends none waits here, holding a
    connection and no share of the bound, until the edge's body deadlines close it. What
    arrived, and what the server reads on behind it before it pauses, is a few hundred KiB
    at most a connection (one 256 KiB read and its 64 KiB of flow control, twice)."""
    arrived: list[dict] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        arrived.append(message)
        if message.get("body") or not message.get("more_body", False):
            return arrived

"""Job results sent without building them in memory.

A poll of a finished job answers its JSON view with the result inline: the service's JSON
as it is (checked once, when the job finished, so it is copied in, never parsed again), or
anything else as base64. The document is never built whole: its head and tail are small,
and the result between them is read from the queue piece by piece (a fixed size, a
multiple of 3 so that base64 pieces join up), encoded off the event loop, and sent as it
goes, with an exact Content-Length. A 27 MB image polled by 100 clients that never read
holds at most one piece per poll, for at most ``result_send_timeout_s``; the next piece is
read only once the client has taken the last one, and no more than ``max_result_streams``
pieces are read and encoded at once. A poll holds that slot while its piece is read, never
while it waits for its client: 250 clients that never read held every slot for the send
deadline, and every other reader, polls of any finished job included, got 503 (helper-53).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pybase64
from starlette.responses import Response

from services.jobs.broker import QueueUnavailable
from services.jobs.records import stored_object
from services.runtime.edge.protocol import END_EXTENSION
from services.runtime.errors import ApiError

log = logging.getLogger("onecard.jobs")
PIECE = 3 * 64 * 1024  # bytes of result per read (a multiple of 3 for base64): what a stalled poll holds

Reader = Callable[[int, int], Awaitable[bytes]]   # (start, size) -> bytes of the stored result
Slot = Callable[[], Awaitable[Callable[[], None]]]  # waits for a slot; returns its release


def b64_length(n: int) -> int:
    return 4 * ((n + 2) // 3)


def inline_parts(view: dict[str, Any], fields: dict[str, str], size: int | None) -> tuple[bytes, bytes, bool]:
    """(head, tail, base64?) around the result in the job's JSON view; without a result,
    head is the whole document."""
    doc = json.dumps({**view, "result": None}).encode()
    assert doc.endswith(b"null}")
    if size is None:
        return doc, b"", False
    head, tail = doc[:-5], b"}"
    if fields.get("result_json") == "1":
        return head, tail, False
    ctype = fields.get("result_type", "")
    key = "image" if ctype.startswith("image/") else "data"
    inner = {"content_type": ctype, key: ""}
    seed = stored_object(fields.get("result_headers")).get("x-seed")
    if seed:
        inner["seed"] = seed
    text = json.dumps(inner).encode()
    cut = text.index(b'""', text.index(f'"{key}"'.encode()) + len(key) + 2) + 1  # inside the empty string
    return head + text[:cut], text[cut:] + tail, True


async def first_piece(read: Reader, size: int) -> bytes | None:
    """The result's first piece, read before the answer starts; None when the result expired
    since its size was read. A result of one piece (up to 192 KiB) is then sent whole or not
    at all: a poll at the moment it expires gets an answer without it, never a cut one."""
    want = min(PIECE, size)
    piece = await read(0, want) if want else b""
    return piece if len(piece) == want else None


class LiveStreams:
    """Results being sent now. When all have ended after many at once, the heap is trimmed
    off the loop: their pieces (192 KiB, under malloc's mmap threshold, so from its heap)
    were freed into arenas that kept them, and 700 readers that never read left the service
    150 MiB above its start."""

    TRIM_AFTER = 16  # streams at once

    def __init__(self, trim: Callable[[], Any]):
        self.trim = trim
        self.live = self.peak = 0

    def begin(self) -> None:
        self.live += 1
        self.peak = max(self.peak, self.live)

    def end(self) -> None:
        self.live -= 1
        if self.live == 0 and self.peak >= self.TRIM_AFTER:
            self.peak = 0
            self.trim()


class StreamedBody(Response):
    """An ASGI response: head, the stored result in pieces (base64 or as is), tail. A
    client that takes no piece within the send deadline is cut off; a result of several
    pieces that expires mid-way ends the connection short of its Content-Length, which the
    client sees (the first piece is read before the answer starts: see first_piece)."""

    def __init__(self, head: bytes, tail: bytes, size: int, first: bytes, read: Reader, encode: bool, media_type: str,
                 cpu: Callable[..., Awaitable[Any]], send_timeout_s: float, headers: dict[str, str] | None = None,
                 status: int = 200, slot: Slot | None = None, live: LiveStreams | None = None):
        self.head, self.tail, self.size, self.first, self.read, self.encode = head, tail, size, first, read, encode
        self.media_type, self.cpu, self.send_timeout_s = media_type, cpu, send_timeout_s
        self.extra_headers, self.status_code, self.slot, self.live = headers or {}, status, slot, live
        self.background = None  # what FastAPI attaches its background tasks to
        body_len = b64_length(size) if encode else size
        self.length = len(head) + body_len + len(tail)

    async def _pieces(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        done = 0
        while done < self.size:
            release = await self.slot() if self.slot is not None and done else None
            try:
                piece = self.first if done == 0 else await self.read(done, min(PIECE, self.size - done))
                if not piece:
                    raise ConnectionAbortedError("the result expired while it was sent")
                done += len(piece)
                # pybase64 releases the GIL for the piece (the probes keep their turn)
                out = await self.cpu(len(piece), pybase64.b64encode, piece) if self.encode else piece
            finally:
                if release is not None:
                    release()
            yield out
        if self.tail:
            yield self.tail

    async def __call__(self, scope, receive, send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))
        if self.live is not None:
            self.live.begin()
        try:
            headers = [(b"content-type", self.media_type.encode("latin-1")),
                       (b"content-length", str(self.length).encode())]
            headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.extra_headers.items()]
            await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
            async for piece in self._pieces():
                if gone.done():  # the client left: read and encode no more of it
                    return
                async with asyncio.timeout(self.send_timeout_s):
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                    # the next piece is read once the client has taken this one: an empty send
                    # waits for the transport's buffer to drain (uvicorn's flow control)
                    await send({"type": "http.response.body", "body": b"", "more_body": True})
            async with asyncio.timeout(self.send_timeout_s):
                await send({"type": "http.response.body", "body": b""})
        except (TimeoutError, ConnectionAbortedError) as exc:
            log.info("jobs: a result was cut off: %s", exc if str(exc) else "the client read nothing in time")
            _end_short(scope, hard=True)  # what it did not read is dropped
        except QueueUnavailable as exc:  # a piece not read in time: the answer has begun, it can only end short
            log.warning("jobs: a result was cut off: %s", exc)
            _end_short(scope, hard=False)  # the client reads what was sent
        except ApiError as exc:  # no slot came free for a piece in result_stream_wait_s
            log.warning("jobs: a result was cut off: %s", exc.message)
            _end_short(scope, hard=False)
        finally:
            gone.cancel()
            if self.live is not None:
                self.live.end()


def _end_short(scope, hard: bool) -> None:
    """An answer that ends short ends its connection (the edge's extension; a server without
    it closes the connection itself when the answer is left incomplete)."""
    end = scope.get("extensions", {}).get(END_EXTENSION)
    if end is not None:
        end(hard)


async def _disconnected(receive) -> None:
    """Returns once the client has gone (a GET's request message comes first)."""
    while (await receive())["type"] != "http.disconnect":
        pass

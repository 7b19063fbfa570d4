"""How fast and in what pieces a request body arrives.

``body_timeout_s`` bounds a body's whole time, but within it an upload that trickles holds
its connection (and whatever the service set aside for it) for the full minute: 32 of them
sending a few bytes a second kept every queue slot of a service. A body must therefore also
keep a minimum average rate once a short grace has passed (Apache's ``mod_reqtimeout`` has
the same rule: ``body=...,MinRate=...``). Time during which the body is not the
client's to send does not count: reading paused because the app has not taken what arrived,
or a client waiting for its ``100 Continue``.

A chunked body's framing costs per chunk, not per byte: uvicorn hands the app every chunk
through a Python callback and a bytes concatenation on the event loop (44 MB of 1-byte
chunks cost the loop about 300 ms). A body whose chunks stay tiny on average after its first
``CHUNK_GRACE`` chunks is refused; a client that streams real pieces (kilobytes) never is.

What a chunked body sends besides its data (chunk-size lines, their extensions, the trailer
fields after the last chunk) is bounded like a head: an endless trailer value (no line end)
is kept whole by the parser until it ends, 35 MB a connection before the body's wire cap, and
an endless chunk-size line of zeros costs the loop its reads. Past ``max_header_bytes`` plus
``CHUNK_LINE_BYTES`` a chunk, it is refused within the read that passes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

RATE_TICK_S = 1.0     # how often a body's rate is looked at
CHUNK_GRACE = 1024    # chunks a body may send before their average size is judged
CHUNK_LINE_BYTES = 64  # a chunk's own framing: its size line (and a short extension), its line end


class BodyRate:
    """Watches one body's average receive rate while it is the client's to send."""

    __slots__ = ("loop", "min_rate", "grace_s", "received", "client_waits", "on_too_slow", "tick_s", "_timer",
                 "_since", "_base")

    def __init__(self, loop: asyncio.AbstractEventLoop, min_rate: int, grace_s: float, received: Callable[[], int],
                 client_waits: Callable[[], bool], on_too_slow: Callable[[], None], tick_s: float = RATE_TICK_S):
        self.loop, self.min_rate, self.grace_s, self.tick_s = loop, min_rate, grace_s, tick_s
        self.received, self.client_waits, self.on_too_slow = received, client_waits, on_too_slow
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        self._base = 0

    def start(self) -> None:
        """The body is the client's to send from now (no effect while already watching)."""
        if self._timer is None and self.min_rate > 0:
            self._restart()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _restart(self) -> None:
        self._since, self._base = self.loop.time(), self.received()
        self._timer = self.loop.call_later(self.tick_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.client_waits():  # our pause, not the client's: the average starts again after it
            self._restart()
            return
        elapsed = self.loop.time() - self._since
        if elapsed >= self.grace_s and self.received() - self._base < self.min_rate * elapsed:
            self.on_too_slow()
            return
        self._timer = self.loop.call_later(self.tick_s, self._tick)


def chunks_too_small(chunks: int, body_bytes: int, min_chunk_bytes: int) -> bool:
    """After CHUNK_GRACE chunks, do the finished ones (all but the newest) average under
    ``min_chunk_bytes``?"""
    return min_chunk_bytes > 0 and chunks > CHUNK_GRACE and body_bytes < min_chunk_bytes * (chunks - 1)


def framing_too_large(framing_bytes: int, chunks: int, max_header_bytes: int) -> bool:
    """Has a chunked body's framing (all it sent but its data) passed what its chunks' lines
    and a head's worth of trailer fields may take?"""
    return framing_bytes > max_header_bytes + CHUNK_LINE_BYTES * chunks

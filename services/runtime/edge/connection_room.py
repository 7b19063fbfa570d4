"""Which connection gives way when a public port holds ``max_connections``.

Refusing every newcomer at the limit hands the port to whoever opens connections first:
600 sockets that never send a byte would take ``/healthz`` away from the orchestrator and
every client away from the service until their header deadline. So, as the supervisor's
probe port does (supervisor/servers/connection_slots.py), a newcomer is not turned away
while some connection does nothing useful: the one idle longest is closed to make room,
that is one that never sent a byte or a kept-alive one between requests (a client must
expect a kept-alive connection to close at any time). Failing those, the one that has
waited longest for the rest of an unfinished request head. Failing those, one whose request
body is owed by its client and has stalled (nothing for STALLED_BODY_S, its reading not held
back by the service): 600 clients that send a head with ``Expect: 100-continue`` and then no
body held every connection in progress, and every newcomer, /healthz included, got 503 until
their body deadline. A connection with any other request in progress (its body arriving or
held back by the service, its answer being made or sent, requests pipelined behind it) is
never closed that way: only when every connection has one is a newcomer refused, unless
what it sent is already a whole request with nothing more to wait for (a probe, a small
upload): it is answered and gone at once, so up to QUICK_OVERFLOW such newcomers are taken
beyond the limit (connections that hold bodies back kept /healthz at 503 otherwise: each one
that made room was taken at once by the holders' own reconnects).

Real clients send their request the moment they connect, usually before the service
accepts them: a newcomer whose bytes are already waiting counts as a head arriving, not
as idle, so a flood of silent connections makes room with its own members first.

Event loop thread only; no lock.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, Protocol

from common.socket_queues import has_bytes_waiting
from services.runtime.edge.connection_limits import error_bytes

LINGER_S = 1.0
STALLED_BODY_S = 1.0   # a body owed by its client with nothing for this long may make room
STALLED_SCAN = 32      # bodies looked at for one newcomer (those the service holds back go last)
QUICK_OVERFLOW = 1 / 8  # of the limit: newcomers with a whole request taken beyond it (at least 8)
OVERFLOW = 2            # make_room's answer for a newcomer taken beyond the limit (True: within it)
MAX_LINGERING = 1024
_lingering = [0]  # refused connections still draining, across the process (event loop thread only)


class Evictable(Protocol):
    def give_way(self) -> None:
        """Close now to make room for a newcomer."""

    def owes_body(self) -> bool:
        """Is the rest of its request body the client's to send now (not held back by us)?"""


class ConnectionRoom:
    def __init__(self, limit: int):
        self.limit = limit
        self._idle: dict[Evictable, None] = {}       # insertion order: idle the longest first
        self._arriving: dict[Evictable, None] = {}   # a head begun: waiting the longest first
        self._bodies: dict[Evictable, float] = {}    # a body arriving, by the time of its last read
        self._leaving: set[Evictable] = set()        # closed to make room, not gone yet

    def make_room(self, open_now: int, now: float = 0.0, quick: Callable[[], bool] = lambda: False) -> bool | int:
        """Before a newcomer is accepted (``open_now`` connections are open, ``now`` on the
        loop's clock): True when it may stay, after closing the longest idle connection (or
        failing that, an arriving head, then a stalled body) if the port is full, or when
        ``quick()`` says it sent a whole request and the overflow has room (then OVERFLOW: the
        connection serves that request only); False when every connection has a request in
        progress."""
        if open_now - len(self._leaving) < self.limit:
            return True
        # one taken as idle whose request has arrived since (not read yet on a busy loop) is
        # arriving: it moves on, once, and the next idle one is looked at
        while self._idle and has_bytes_waiting(getattr(first := next(iter(self._idle)), "transport", None)):
            self.arriving(first)
        pool = self._idle or self._arriving
        victim = next(iter(pool)) if pool else self._stalled_body(now)
        if victim is None:
            overflow = max(8, int(self.limit * QUICK_OVERFLOW))
            return OVERFLOW if open_now - len(self._leaving) < self.limit + overflow and quick() else False
        for listed in (self._idle, self._arriving, self._bodies):
            listed.pop(victim, None)
        self._leaving.add(victim)  # still open until its connection_lost: not counted twice
        victim.give_way()
        return True

    def _stalled_body(self, now: float) -> Evictable | None:
        """The body owed the longest, if nothing came for it for STALLED_BODY_S; one the service
        holds back goes to the end of the list (its time kept) and the next is looked at."""
        for _ in range(min(STALLED_SCAN, len(self._bodies))):
            conn, last_read = next(iter(self._bodies.items()))
            if now - last_read < STALLED_BODY_S:
                return None  # the rest were read later (bar those moved to the end)
            if conn.owes_body():
                return conn
            del self._bodies[conn]
            self._bodies[conn] = last_read
        return None

    def arrived(self, conn: Evictable, transport: Any) -> None:
        """A connection accepted: idle, unless its request's bytes are already waiting."""
        if has_bytes_waiting(transport):
            self.arriving(conn)
        else:
            self.no_request(conn)

    def no_request(self, conn: Evictable) -> None:
        """Nothing in progress (sent nothing yet, or kept alive after its answers): idle from now."""
        if conn not in self._leaving:
            self._arriving.pop(conn, None)
            self._idle.pop(conn, None)
            self._idle[conn] = None

    def arriving(self, conn: Evictable) -> None:
        """A request head arriving; it keeps its place while more of it comes."""
        if conn not in self._leaving:
            self._idle.pop(conn, None)
            self._arriving.setdefault(conn, None)

    def body_arriving(self, conn: Evictable, last_read: float) -> None:
        """A request body arriving, its last bytes read at ``last_read``: closed to make room
        only once it has stalled (see _stalled_body)."""
        if conn not in self._leaving:
            self._idle.pop(conn, None)
            self._arriving.pop(conn, None)
            self._bodies.pop(conn, None)
            self._bodies[conn] = last_read

    def busy(self, conn: Evictable) -> None:
        """A request in progress: never closed to make room."""
        self._idle.pop(conn, None)
        self._arriving.pop(conn, None)
        self._bodies.pop(conn, None)

    def gone(self, conn: Evictable) -> None:
        self.busy(conn)
        self._leaving.discard(conn)

    def counts(self) -> dict[str, int]:
        return {"idle": len(self._idle), "arriving": len(self._arriving), "bodies": len(self._bodies),
                "leaving": len(self._leaving)}


def whole_request(data: bytes) -> bool:
    """Is ``data`` exactly one request with nothing more to wait for: its head and all of its
    body, nothing after (no chunked body, no Expect: 100-continue, a Content-Length that reads
    as one number)?"""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = data[:end].lower()
    if b"\nexpect:" in head or b"\ntransfer-encoding:" in head:
        return False
    if b"\ncontent-length:" not in head:
        return len(data) == end + 4
    length = re.search(rb"\ncontent-length:[ \t]*(\d+)[ \t]*(?:\r|$)", head)
    return length is not None and len(data) == end + 4 + int(length.group(1))


def too_many_connections(limit: int) -> bytes:
    return error_bytes(503, "too_many_connections", f"the service holds {limit} connections; retry later",
                       b"retry-after: 1\r\n")


class RefusedNewcomer:
    """A newcomer refused because every connection has a request in progress: 503, then a
    lingering close (half-close, drain what the client sends, close on its EOF or after
    LINGER_S). Closing with unread data would send a reset that destroys the 503 before the
    client reads it. Bounded: past MAX_LINGERING (or the connection limit) refused
    connections draining at once, the next are closed at once."""

    __slots__ = ("_timer", "_counted")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, limit: int):
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False
        transport.write(too_many_connections(limit))
        if _lingering[0] >= min(MAX_LINGERING, limit) or not transport.can_write_eof():
            transport.close()
            return
        try:
            transport.write_eof()
        except OSError:  # the client reset the connection before it was accepted: nothing to linger for
            transport.close()
            return
        _lingering[0] += 1
        self._counted = True
        self._timer = loop.call_later(LINGER_S, transport.close)

    def gone(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counted:
            self._counted = False
            _lingering[0] -= 1

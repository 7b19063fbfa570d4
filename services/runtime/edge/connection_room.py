"""Which connection gives way when a public port holds ``max_connections``.

Refusing every newcomer at the limit hands the port to whoever opens connections first:
600 sockets that never send a byte would take ``/healthz`` away from the orchestrator and
every client away from the service until their header deadline. So, as the supervisor's
probe port does (supervisor/servers/connection_slots.py), a newcomer is not turned away
while some connection does nothing useful: the one idle longest is closed to make room,
that is one that never sent a byte or a kept-alive one between requests (a client must
expect a kept-alive connection to close at any time). Failing those, the one that has
waited longest for the rest of an unfinished request head. A connection with a request in
progress (its body arriving, its answer being made or sent, requests pipelined behind it)
is never closed that way: only when every connection has one is a newcomer refused.

Real clients send their request the moment they connect, usually before the service
accepts them: a newcomer whose bytes are already waiting counts as a head arriving, not
as idle, so a flood of silent connections makes room with its own members first.

Event loop thread only; no lock.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from common.socket_queues import has_bytes_waiting
from services.runtime.edge.connection_limits import error_bytes

LINGER_S = 1.0
MAX_LINGERING = 1024
_lingering = [0]  # refused connections still draining, across the process (event loop thread only)


class Evictable(Protocol):
    def give_way(self) -> None:
        """Close now to make room for a newcomer."""


class ConnectionRoom:
    def __init__(self, limit: int):
        self.limit = limit
        self._idle: dict[Evictable, None] = {}       # insertion order: idle the longest first
        self._arriving: dict[Evictable, None] = {}   # a head begun: waiting the longest first
        self._leaving: set[Evictable] = set()        # closed to make room, not gone yet

    def make_room(self, open_now: int) -> bool:
        """Before a newcomer is accepted (``open_now`` connections are open): True when it may
        stay, after closing the longest idle connection if the port is full; False when every
        connection has a request in progress."""
        if open_now - len(self._leaving) < self.limit:
            return True
        # one taken as idle whose request has arrived since (not read yet on a busy loop) is
        # arriving: it moves on, once, and the next idle one is looked at
        while self._idle and has_bytes_waiting(getattr(first := next(iter(self._idle)), "transport", None)):
            self.arriving(first)
        pool = self._idle or self._arriving
        if not pool:
            return False
        victim = next(iter(pool))
        del pool[victim]
        self._leaving.add(victim)  # still open until its connection_lost: not counted twice
        victim.give_way()
        return True

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

    def busy(self, conn: Evictable) -> None:
        """A request in progress: never closed to make room."""
        self._idle.pop(conn, None)
        self._arriving.pop(conn, None)

    def gone(self, conn: Evictable) -> None:
        self._idle.pop(conn, None)
        self._arriving.pop(conn, None)
        self._leaving.discard(conn)

    def counts(self) -> dict[str, int]:
        return {"idle": len(self._idle), "arriving": len(self._arriving), "leaving": len(self._leaving)}


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
        _lingering[0] += 1
        self._counted = True
        transport.write_eof()
        self._timer = loop.call_later(LINGER_S, transport.close)

    def gone(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counted:
            self._counted = False
            _lingering[0] -= 1

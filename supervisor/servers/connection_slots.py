"""Connection slots for the supervisor's two servers (the probe port, the control socket), and
the close they share.

A bounded number of connections is open at once. When every slot is taken, a newcomer is
not turned away: the connection that has waited longest without sending anything is closed
to make room, else the one that has waited longest for the rest of an unfinished request.
A connection whose request is complete (being answered) is never closed that way. Real
callers (an orchestrator's probe, `onecard status`) send their whole request the moment
they connect, usually before the supervisor even accepts them, so clients that connect and
send nothing, or trickle, cannot lock them out: they are the ones that make room. Only when
every slot holds a request being answered is a newcomer closed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from common.http1 import whole_request
from common.socket_queues import has_bytes_waiting, waiting_bytes

MAX_PEEK = 16 * 1024  # a probe's whole request is far smaller


def _fd(writer: Any) -> int:
    try:
        return writer.get_extra_info("socket").fileno()
    except (OSError, AttributeError, ValueError):
        return -1


class Slots:
    def __init__(self, limit: int):
        self.limit = limit
        self._empty: dict[Any, None] = {}    # nothing received yet; insertion order: oldest first
        self._partial: dict[Any, None] = {}  # some bytes, no complete request yet
        self._busy: set[Any] = set()         # request complete: being answered
        self.closed_early = 0                # closed to make room, and newcomers refused

    def __len__(self) -> int:
        return len(self._empty) + len(self._partial) + len(self._busy)

    def admit(self, writer: Any) -> bool:
        """Take a slot for a new connection; False when it must be closed at once."""
        if len(self) >= self.limit:
            self.closed_early += 1
            # a connection taken as silent whose request has arrived since (on a busy loop, a
            # probe connected a moment before it sent) is not silent: it moves on, once
            while self._empty and has_bytes_waiting(first := next(iter(self._empty))):
                del self._empty[first]
                self._partial[first] = None
            # one whose whole request is waiting unread is about to be answered: never closed
            oldest = next(iter(self._empty), None) or next(
                (w for w in self._partial if not whole_request(waiting_bytes(_fd(w), MAX_PEEK))), None)
            if oldest is None:
                return False
            (self._empty if oldest in self._empty else self._partial).pop(oldest)
            oldest.transport.abort()  # its handler sees the reset and leaves
        (self._partial if has_bytes_waiting(writer) else self._empty)[writer] = None
        return True

    def started(self, writer: Any) -> None:
        """It sent its first bytes."""
        if writer in self._empty:
            del self._empty[writer]
            self._partial[writer] = None

    def working(self, writer: Any) -> None:
        """Its request is complete: it is not closed to make room any more."""
        self._empty.pop(writer, None)
        self._partial.pop(writer, None)
        self._busy.add(writer)

    def leave(self, writer: Any) -> None:
        self._empty.pop(writer, None)
        self._partial.pop(writer, None)
        self._busy.discard(writer)


class ClosableServer:
    """What the supervisor's two servers share: closed once, waiting a bounded time for the
    connections being answered."""

    _server: asyncio.AbstractServer | None = None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except TimeoutError:
                pass
            self._server = None

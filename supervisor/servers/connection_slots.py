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

A connection accepted under ``FRESH_S`` ago never makes room: on a loaded machine a probe's
client may be descheduled between its connect and its send, and reconnecting holders turned
the slots over so fast that it was closed, silent, before its request came (a probe failure).
A newcomer that finds no room waits up to ``LATE_S`` for its whole request (at most
``LATE_PER_SLOT`` per slot at once, holding no slot; past that, the one waiting longest is
closed and the newcomer waits in its stead: refused at once, a probe whose bytes came a moment
after its connect failed among 4 silent clients per slot a second): one that comes is answered in a slot
that came free or beyond the limit (at most ``OVERFLOW`` of them, waiting for one of those
to leave if need be, within the same ``LATE_S``), the others are closed. Holders that reconnect the
moment they are closed are paced by that wait, instead of turning the slots over at the
loop's speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from common.http1 import HeadTimeout, HeadTooLarge, whole_request
from common.socket_queues import has_bytes_waiting, waiting_bytes

MAX_PEEK = 16 * 1024  # a probe's whole request is far smaller
FRESH_S = 1.0         # accepted under this long ago: never closed to make room
OVERFLOW = 8          # newcomers whose whole request is in, answered beyond the limit at once
LATE_S = 0.5          # how long a newcomer with no room waits for its whole request
LATE_PER_SLOT = 4     # newcomers waiting so at once, per slot (a bound on descriptors held)


def _fd(writer: Any) -> int:
    try:
        return writer.get_extra_info("socket").fileno()
    except (OSError, AttributeError, ValueError):
        return -1


Buffered = Callable[[], bytes]
Request = TypeVar("Request")


def _whole(writer: Any, buffered: Buffered | None) -> bool:
    """Has its whole request arrived? (An asyncio stream reads a new connection's first bytes
    before its handler runs: they are in the reader's buffer, not in the socket.)"""
    head = buffered() if buffered is not None else b""
    return whole_request(head + waiting_bytes(_fd(writer), MAX_PEEK))


class Slots:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic, fresh_s: float = FRESH_S):
        self.limit, self.clock, self.fresh_s = limit, clock, fresh_s
        # values: when accepted; insertion order: oldest first
        self._empty: dict[Any, float] = {}    # nothing received yet
        self._partial: dict[Any, float] = {}  # some bytes, no complete request yet
        self._busy: set[Any] = set()          # request complete: being answered
        self._overflow: set[Any] = set()      # taken beyond the limit with a whole request
        self._late: dict[asyncio.Future, None] = {}  # newcomers waiting for their request (admit_late), oldest first
        self._late_count = 0                  # newcomers in admit_late, those waiting for room included
        self._left: asyncio.Future | None = None  # done when a connection leaves (admit_late)
        self.closed_early = 0                 # closed to make room, and newcomers refused

    def __len__(self) -> int:
        return len(self._empty) + len(self._partial) + len(self._busy)

    def admit(self, writer: Any, buffered: Buffered | None = None) -> bool:
        """Take a slot for a new connection; False when there is no room for it now (then
        admit_late, or close it). ``buffered``: what its reader already took off the socket."""
        if len(self) >= self.limit:
            oldest = self._to_close()
            if oldest is None:
                return self._take_beyond(writer, buffered)
            self.closed_early += 1
            (self._empty if oldest in self._empty else self._partial).pop(oldest)
            oldest.transport.abort()  # its handler sees the reset and leaves
        (self._partial if has_bytes_waiting(writer) else self._empty)[writer] = self.clock()
        return True

    def _to_close(self) -> Any | None:
        """The connection that makes room: the oldest silent one, else the oldest whose request
        is unfinished; never one accepted under fresh_s ago, nor one whose whole request waits."""
        # a connection taken as silent whose request has arrived since (on a busy loop, a
        # probe connected a moment before it sent) is not silent: it moves on, once
        while self._empty and has_bytes_waiting(first := next(iter(self._empty))):
            self._partial[first] = self._empty.pop(first)
        settled = self.clock() - self.fresh_s
        oldest = next(iter(self._empty), None)
        if oldest is not None and self._empty[oldest] <= settled:
            return oldest
        return next((w for w, since in self._partial.items()
                     if since <= settled and not _whole(w, None)), None)

    def _take_beyond(self, writer: Any, buffered: Buffered | None) -> bool:
        if len(self._overflow) >= OVERFLOW or not _whole(writer, buffered):
            return False
        self._overflow.add(writer)
        self._busy.add(writer)
        return True

    async def admit_late(self, writer: Any, read_request: Callable[[], Awaitable[Request]]) -> Request | None:
        """A newcomer admit() found no room for: ``read_request()`` reads its whole request,
        and the request is returned if it came within LATE_S and room came for it by then (a
        slot, or a place beyond the limit: those answers are quick); else None (counted as
        closed early). The waits are on the connection's own data and on a connection
        leaving, no polling. At most LATE_PER_SLOT x `limit` wait at once: past that, the
        one waiting longest for its request (it had the most time to send) is closed, and
        this one waits; when every one has its request in and waits for room, this one is
        closed. The wait also paces clients that reconnect the moment they are closed."""
        loop = asyncio.get_running_loop()
        if self._late_count >= LATE_PER_SLOT * self.limit:
            if not self._late:  # every one of them has its whole request, waiting for room
                self.closed_early += 1
                return None
            oldest = next(iter(self._late))
            del self._late[oldest]
            self._late_count -= 1
            oldest.set_result(None)  # its wait ends here: closed early
        given_up = loop.create_future()
        self._late[given_up] = None
        self._late_count += 1
        deadline = loop.time() + LATE_S
        reading = asyncio.ensure_future(read_request())
        try:
            await asyncio.wait((reading, given_up), timeout=LATE_S, return_when=asyncio.FIRST_COMPLETED)
            self._late.pop(given_up, None)  # its request is in (or never came): no longer the one to close
            if reading.done() and not given_up.done():
                request = reading.result()
                if await self._room_by(deadline):
                    if len(self) >= self.limit:
                        self._overflow.add(writer)
                    self._busy.add(writer)
                    return request
        except (TimeoutError, OSError, asyncio.IncompleteReadError, HeadTooLarge, HeadTimeout):
            pass
        finally:
            self._late.pop(given_up, None)
            if not given_up.done():  # one closed to make way was uncounted then
                self._late_count -= 1
            if not reading.done():
                reading.cancel()
            elif not reading.cancelled():
                reading.exception()  # looked at: a read that failed is a newcomer closed, no log line
        self.closed_early += 1
        return None

    async def _room_by(self, deadline: float) -> bool:
        """Wait until there is room (a slot, or a place beyond the limit) or the deadline."""
        loop = asyncio.get_running_loop()
        while len(self) >= self.limit and len(self._overflow) >= OVERFLOW:
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._left is None:
                self._left = loop.create_future()
            try:  # shielded: one waiter's timeout must not cancel what the others wait on
                await asyncio.wait_for(asyncio.shield(self._left), left)
            except TimeoutError:
                return False
        return True

    def started(self, writer: Any) -> None:
        """It sent its first bytes."""
        if writer in self._empty:
            self._partial[writer] = self._empty.pop(writer)

    def working(self, writer: Any) -> None:
        """Its request is complete: it is not closed to make room any more."""
        self._empty.pop(writer, None)
        self._partial.pop(writer, None)
        self._busy.add(writer)

    def leave(self, writer: Any) -> None:
        self._empty.pop(writer, None)
        self._partial.pop(writer, None)
        self._busy.discard(writer)
        self._overflow.discard(writer)
        left, self._left = self._left, None
        if left is not None and not left.done():
            left.set_result(None)  # late newcomers waiting for room look again


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

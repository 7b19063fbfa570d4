"""Uploads take turns on the event loop: at most READS_PER_TURN paused connections resume
reading in one turn of the loop, the others in the turns after, first come first served.

An upload's body arrives a piece at a time (up to 256 KiB a read); after each piece the
connection pauses until the app has taken it, then resumes. Every piece costs the loop about
160 us (the read, the parser, the hand-over to the app), and each turn of the loop ran one
piece of every upload in flight: with sixteen 20 MB uploads a turn took 2.5-3 ms, and a
/healthz probe, which needs four or five turns (accept, connection, read, answer), waited
12-15 ms. With turns bounded, a turn moves about a megabyte and the probes' few handles come
round between them; the uploads lose nothing but the loop's idle gaps (the copy and decode
after them are the slower part).

Connections that never pause (small bodies, probes, answers) are not affected.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl

from common.socket_queues import unread_bytes

READS_PER_TURN = 4
READ_AT_ONCE_BYTES = 16 * 1024   # a request head, a probe, a small body: not an upload's first piece


def read_at_once(transport: Any) -> bool:
    """On a new connection whose client sent a small request with its connect (every probe,
    most clients), read it now instead of in the loop's next turn: a /healthz probe waits
    one turn fewer (accept, start, connection and read, answer), and in a turn of a busy
    service every upload in flight moves a piece. An upload's first piece (more bytes
    waiting) waits for the reader as before: a burst of accepted uploads must not all be
    read in one turn. Whether it was read now."""
    read = getattr(transport, "_read_ready", None)  # asyncio's selector transport; others read as usual
    if read is None or transport.is_closing() or not getattr(transport, "is_reading", lambda: False)():
        return False
    try:
        fd = transport.get_extra_info("socket").fileno()
    except (OSError, AttributeError, ValueError):
        return False
    if not 0 < unread_bytes(fd) <= READ_AT_ONCE_BYTES:
        return False
    read()
    return True


class LoopTurns:
    """At most ``per_turn`` pieces of work run in one turn of the event loop, first come first
    served; the others in the turns after (counted in ``stats.<counter>``). A piece that turns
    out to have nothing left to do when its turn comes (it returns False) does not count.
    Shared by the connections of one event loop; event loop thread only."""

    def __init__(self, stats: type | None, counter: str, per_turn: int):
        self.stats, self.counter, self.per_turn = stats, counter, per_turn
        self.deferred = 0
        self._used = 0
        self._waiting: deque[Callable[[], bool | None]] = deque()
        self._armed = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def run(self, work: Callable[[], bool | None], loop: asyncio.AbstractEventLoop) -> None:
        """``work`` now if this turn has room, else in a later turn."""
        if self._used < self.per_turn and not self._waiting:
            self._used += 1
            work()
        else:
            self.deferred += 1
            if self.stats is not None:
                setattr(self.stats, self.counter, getattr(self.stats, self.counter) + 1)
            self._waiting.append(work)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        # a callback made now runs after this turn's ready callbacks: at the start of the next
        if not self._armed:
            self._armed = True
            loop.call_soon(self._next_turn, loop)

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._armed = False
        self._used = 0
        while self._waiting and self._used < self.per_turn:
            if self._waiting.popleft()() is not False:
                self._used += 1
        if self._waiting or self._used:
            self._arm(loop)


class ReadTurns(LoopTurns):
    """Paused uploads resume reading a few per turn."""

    def __init__(self, stats: type | None = None, per_turn: int = READS_PER_TURN):
        super().__init__(stats, "reads_deferred", per_turn)

    def resume(self, flow: TurnedFlowControl, loop: asyncio.AbstractEventLoop) -> None:
        self.run(flow.resume_now, loop)


class TurnedFlowControl(FlowControl):
    """uvicorn's flow control, whose resumes of reading wait for a turn."""

    def __init__(self, transport: asyncio.Transport, turns: ReadTurns, loop: asyncio.AbstractEventLoop):
        super().__init__(transport)
        self._turns, self._loop = turns, loop
        self._wanted = False    # a resume asked for and not yet done (or taken back by a pause)

    def pause_reading(self) -> None:
        self._wanted = False
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self._wanted:
            self._wanted = True
            self._turns.resume(self, self._loop)

    def resume_now(self) -> bool:
        """Resume, if that is still wanted; whether it was."""
        if not self._wanted:
            return False
        self._wanted = False
        if not self.read_paused or self._transport.is_closing():
            return False
        super().resume_reading()
        return True

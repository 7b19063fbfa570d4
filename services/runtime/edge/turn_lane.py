"""The door's listeners are looked at between the callbacks of a long turn of the event loop,
not only once a turn.

A turn of asyncio's loop runs every callback that was ready when it began before it polls
its sockets again, so a connection that arrives early in a turn waits for all of it, a
/healthz probe's among them. The turns are bounded (start_turns, read_turns, the door's own
set-ups) but still add up: 700 clients asking the jobs service for a result and reading none
of it, each reconnecting as soon as it is reset (about 180 connections a second, each some
5 ms of the loop: its set-up, its request through the app, its answer's first pieces, its
reset), kept the loop 70-95 % busy in turns of 10-60 ms, and jobs' /healthz p99 at 16-34 ms.

Here the loop's queue of ready callbacks is a deque whose popleft first runs `look` (the
door's poll of its listeners, no wait) when LOOK_EVERY_S has passed since it last did: a
probe waits for at most the callback that runs when it arrives, plus LOOK_EVERY_S, rather
than for the turn. Only the accepting moves forward (a whole GET /healthz answered there,
the others queued for their set-up as before, SETUPS_PER_TURN a turn): the rest of the
turn's work keeps its order. A look takes LOOK_BATCH connections at most. A quiet loop
barely looks: at most once per LOOK_EVERY_S (the first callback after an idle wait does),
a poll of a few microseconds.

A long turn is a loop that runs (each of its callbacks is progress): a probe answered in
the middle of one says so, as it would at the turn's end. A callback that does not return
(a blocking call, a stuck loop) still stops every look, and liveness sees it as before.

Installed only on asyncio's own loop (its `_ready` deque, which its `_run_once` pops each
callback from); another loop (uvloop) accepts once a turn as before, and the service says so
in its log. Each callback costs about 0.5 us more (popleft in Python).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("onecard.edge")

LOOK_EVERY_S = 0.002


class TurnLane(deque):
    """The ready queue of an asyncio loop, looking at the listeners between its callbacks."""

    def __init__(self, ready: deque, look: Callable[[], None], every_s: float = LOOK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(ready)
        self.look, self.every_s, self.clock = look, every_s, clock
        self.next_look = clock() + every_s

    def popleft(self) -> Any:
        if self.clock() >= self.next_look:
            try:
                self.look()
            except Exception:  # the loop itself must not fail here: it accepts once a turn again
                log.exception("edge: looking at the listeners between callbacks failed; no longer done")
                self.every_s = float("inf")
            # counted from the look's end: callbacks get at least every_s between looks, however
            # many connections a look takes
            self.next_look = self.clock() + self.every_s
        return super().popleft()


def install(loop: Any, look: Callable[[], None], every_s: float = LOOK_EVERY_S) -> bool:
    """Make `loop` look between its callbacks (in the loop's thread); False where the loop is
    not asyncio's own (nothing changes)."""
    ready = getattr(loop, "_ready", None)
    if type(ready) is TurnLane:
        ready.look, ready.every_s = look, every_s
        return True
    if type(ready) is not deque:
        return False
    # the callbacks of this turn not run yet move over, in their order: _run_once pops the next
    # one from loop._ready, whichever deque that is by then. Best installed before other threads
    # hand the loop callbacks (call_soon_threadsafe appends to whichever deque it found); one
    # appended to the old deque meanwhile is moved after the swap, not lost
    lane = TurnLane((), look, every_s)
    while ready:
        lane.append(ready.popleft())
    loop._ready = lane
    while ready:  # what came meanwhile
        lane.append(ready.popleft())
    return True

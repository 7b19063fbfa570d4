"""Requests start their app a few at a time per turn of the event loop; probes at once.

A turn of asyncio's loop runs every callback that is ready: the I/O of every socket that
has something, then every task step scheduled meanwhile. 600 clients each polling in a loop
on a kept-alive connection made each turn start hundreds of requests (about half a
millisecond of app code each), and a /healthz probe's read waited for all of them: jobs'
/healthz p99 was 200-300 ms (15-28 ms at 8 starts a turn, 8-12 ms at 4, with the same number
of polls answered). Here at most STARTS_PER_TURN requests start in one turn, first
come first served, the rest in the turns after; a GET of a probe's path (PROMPT_PATHS)
starts at once, so it waits for a bounded turn, not for everyone's work. Nothing is lost or
reordered on a connection: its next request starts only after its answer, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.runtime.edge.connection_room import PROBE_TARGETS
from services.runtime.edge.read_turns import LoopTurns

STARTS_PER_TURN = 4
PROMPT_PATHS = frozenset(target.decode() for target in PROBE_TARGETS)  # the probes the overflow spares too


def is_probe(scope: dict) -> bool:
    return scope.get("method") == "GET" and scope.get("path") in PROMPT_PATHS


class PendingStart:
    """A request waiting for its turn to start its app. Its connection lets it go when lost:
    a flood of clients that sent a request and left (5 000 a second, 4 starts a turn) had
    7 000 connections waiting in the queue of starts, each held whole by its start (150 000
    objects for the collector, whose sweeps of them stopped the loop 80-240 ms); let go, an
    entry is an empty shell, skipped without using its turn's room."""

    __slots__ = ("_start", "_cycle", "_app")

    def __init__(self, start: Callable[[Any, Any], None], cycle: Any, app: Any):
        self._start, self._cycle, self._app = start, cycle, app

    def __call__(self) -> bool:
        start, cycle, app = self._start, self._cycle, self._app
        self.let_go()
        if start is None or cycle.disconnected:  # its client left while it waited its turn
            return False
        start(cycle, app)
        return True

    def let_go(self) -> None:
        self._start = self._cycle = self._app = None


class StartTurns(LoopTurns):
    """Shared by the connections of one event loop (event loop thread only)."""

    def __init__(self, stats: type | None = None, per_turn: int = STARTS_PER_TURN):
        super().__init__(stats, "starts_deferred", per_turn)

    def start(self, begin: Callable[[], bool | None], loop: asyncio.AbstractEventLoop, prompt: bool = False) -> None:
        """Run ``begin`` now if this turn has room (or ``prompt``), else in a later turn."""
        if prompt:
            begin()
        else:
            self.run(begin, loop)

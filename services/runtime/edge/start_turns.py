"""Requests start their app a few at a time per turn of the event loop; probes at once.

A turn of asyncio's loop runs every callback that is ready: the I/O of every socket that
has something, then every task step scheduled meanwhile. 600 clients each polling in a loop
on a kept-alive connection made each turn start hundreds of requests (about half a
millisecond of app code each), and a /healthz probe's read waited for all of them: jobs'
/healthz p99 was 200-300 ms. Here at most STARTS_PER_TURN requests start in one turn, first
come first served, the rest in the turns after; a GET of a probe's path (PROMPT_PATHS)
starts at once, so it waits for a bounded turn, not for everyone's work. Nothing is lost or
reordered on a connection: its next request starts only after its answer, as before.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

STARTS_PER_TURN = 8
PROMPT_PATHS = frozenset({"/healthz", "/readyz"})


def is_probe(scope: dict) -> bool:
    return scope.get("method") == "GET" and scope.get("path") in PROMPT_PATHS


class StartTurns:
    """Shared by the connections of one event loop (event loop thread only)."""

    def __init__(self, stats: type | None = None, per_turn: int = STARTS_PER_TURN):
        self.stats, self.per_turn = stats, per_turn
        self.deferred = 0  # starts put off to a later turn
        self._used = 0
        self._waiting: deque[Callable[[], None]] = deque()
        self._armed = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self, begin: Callable[[], None], loop: asyncio.AbstractEventLoop, prompt: bool = False) -> None:
        """Run ``begin`` now if this turn has room (or ``prompt``), else in a later turn."""
        if prompt or (self._used < self.per_turn and not self._waiting):
            if not prompt:
                self._used += 1
            begin()
        else:
            self.deferred += 1
            if self.stats is not None:
                self.stats.starts_deferred += 1
            self._waiting.append(begin)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._armed:  # a callback made now runs after this turn's ready callbacks
            self._armed = True
            loop.call_soon(self._next_turn, loop)

    def _next_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._armed = False
        self._used = 0
        while self._waiting and self._used < self.per_turn:
            self._used += 1
            self._waiting.popleft()()
        if self._waiting or self._used:
            self._arm(loop)

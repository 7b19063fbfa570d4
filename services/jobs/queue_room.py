"""Submits that find the queue full wait in line for room instead of a 503 at once.

The queue refuses a job (QueueFull) while it holds ``max_queued_jobs`` for the model, while
the bodies of waiting and running jobs fill ``max_queued_bytes``, or while Redis is at its
maxmemory; each of these frees as jobs run. A submit that finds no room joins a line: the
one at its head tries again, sooner at first, then every ``MAX_PAUSE_S``; the others wait
their turn, and a submit that arrives while anyone waits goes to the back (first come, first
served: a newcomer never takes the room a waiter was waiting for). Past ``queue_wait_s``
the submit gets its 503 ``queue_full``. Clients that send their next job when the last one
is answered are slowed to the pace of the queue instead of refused (12 sessions of 16 MB
jobs got 16 refusals in 20 s). The waiting submit keeps its place in ``submit_memory_bytes``
with its body, so what waits here is bounded there.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.jobs.broker import JobTooLarge, QueueFull

T = TypeVar("T")
FIRST_PAUSE_S = 0.02
MAX_PAUSE_S = 0.5
LOOK_S = 0.5     # how often a waiter looks whether its client is still there


class ClientGone(Exception):
    """The client of a waiting submit went away."""


class QueueRoom:
    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.waited = 0    # submits that found the queue full and waited
        self.refused = 0   # submits that waited in vain (503 queue_full)
        self.reason = ""   # the queue's last word on why it had no room
        self.left = 0      # submits whose client went away while they waited (no job made)
        self._line: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    async def submit(self, attempt: Callable[[], Awaitable[T]],
                     gone: Callable[[], Awaitable[bool]] | None = None) -> T:
        """``attempt()`` (a broker submit) now, or in turn once the queue has room. A waiter
        whose client has gone (``gone()``, asked every LOOK_S) leaves the line without
        submitting: no job is made for nobody (ClientGone)."""
        if not self._line:
            try:
                return await attempt()
            except JobTooLarge:
                raise  # could never fit: no wait makes room for it
            except QueueFull as exc:
                self.reason = str(exc)
                if self.wait_s <= 0:
                    self.refused += 1
                    raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        turn = loop.create_future()
        self._line.append(turn)
        self.waited += 1
        self._pass_turn()
        try:
            while not turn.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait([turn], timeout=min(LOOK_S, left))
                await self._check(gone)
            pause = FIRST_PAUSE_S
            while True:
                await self._check(gone)
                try:
                    return await attempt()
                except JobTooLarge:
                    raise
                except QueueFull as exc:
                    self.reason = str(exc)
                    left = deadline - loop.time()
                    if left <= 0:
                        self.refused += 1
                        raise QueueFull(f"{exc}; this submit waited {self.wait_s:g} s (queue_wait_s) and found "
                                        "no room") from None
                await asyncio.sleep(min(pause, left))
                pause = min(MAX_PAUSE_S, pause * 2)
        except TimeoutError:
            self.refused += 1
            raise QueueFull(f"{self.reason}; this submit waited {self.wait_s:g} s (queue_wait_s) in line with "
                            f"{len(self._line) - 1} other(s) and found no room") from None
        finally:
            turn.cancel()
            self._line.remove(turn)
            self._pass_turn()

    async def _check(self, gone: Callable[[], Awaitable[bool]] | None) -> None:
        if gone is not None and await gone():
            self.left += 1
            raise ClientGone("the client went away while its submit waited for room")

    def _pass_turn(self) -> None:
        """The head of the line is the one that tries."""
        if self._line and not self._line[0].done():
            self._line[0].set_result(None)

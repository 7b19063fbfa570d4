"""A clock that moves only when told: timers fire in order as it moves, so a scripted
history replays the same way every time (the real one: supervisor/system/clock.py)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import weakref


class ManualClock:
    """Moves only when told; timers fire in order as it moves."""

    def __init__(self):
        self.t = 0.0
        self._timers: list = []
        self._seq = itertools.count()

    def now(self):
        return self.t

    def call_later(self, delay, fn):
        handle = _Handle()
        heapq.heappush(self._timers, (self.t + max(0.0, delay), next(self._seq), fn, handle))
        return handle

    async def sleep(self, delay):
        fut = asyncio.get_running_loop().create_future()
        self.call_later(delay, lambda: fut.done() or fut.set_result(None))
        await fut

    async def advance(self, dt):
        target = self.t + dt
        while self._timers and self._timers[0][0] <= target:
            due, _, fn, handle = heapq.heappop(self._timers)
            self.t = due
            if not handle.cancelled:
                fn()
            await settle()
        self.t = target
        await settle()


class _Handle:
    cancelled = False

    def cancel(self):
        self.cancelled = True


class ThreadWork:
    """The work a scripted history's loop hands to threads (asyncio.to_thread and every other
    run_in_executor, whatever executor the supervisor installs), counted so that settle()
    waits for it rather than for a fixed real time."""

    def __init__(self):
        self.submitted = 0
        self.pending = 0

    def count(self, loop: asyncio.AbstractEventLoop) -> None:
        original = loop.run_in_executor

        def run_in_executor(executor, func, *args):
            future = original(executor, func, *args)
            self.submitted += 1
            self.pending += 1
            future.add_done_callback(self._finished)
            return future

        loop.run_in_executor = run_in_executor  # type: ignore[method-assign]

    def _finished(self, _future) -> None:  # on the loop's thread, as the future completes
        self.pending -= 1


_thread_work: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def count_thread_work(loop: asyncio.AbstractEventLoop) -> None:
    """Make the loop's thread work visible to settle()."""
    work = _thread_work[loop] = ThreadWork()
    work.count(loop)


async def settle(rounds: int = 6, limit_s: float = 30.0):
    """Let the tasks run until they are waiting on the clock alone: a few turns of the loop,
    again while work handed to a thread is unfinished or new (on a loaded machine a thread's
    file or process-table call can outlast a fixed real-time pause, and the clock moved on
    before the step it belonged to had played out)."""
    work = _thread_work.get(asyncio.get_running_loop())
    deadline = time.monotonic() + limit_s
    seen = work.submitted if work is not None else 0
    while True:
        for _ in range(rounds):
            await asyncio.sleep(0.002)
        if work is None or time.monotonic() > deadline:
            return
        pending, submitted = work.pending, work.submitted
        if pending == 0 and submitted == seen:
            return
        seen = submitted if pending == 0 else -1

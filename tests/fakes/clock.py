"""A clock that moves only when told: timers fire in order as it moves, so a scripted
history replays the same way every time (the real one: supervisor/system/clock.py)."""

from __future__ import annotations

import asyncio
import heapq
import itertools


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


async def settle(rounds: int = 6):
    for _ in range(rounds):
        await asyncio.sleep(0.002)

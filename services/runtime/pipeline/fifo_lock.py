"""FifoLock: an asyncio lock that serves waiters strictly in arrival order.

The lock several public webuis use wakes the next waiter and then releases; between
the release and the moment the woken waiter runs, a newcomer can find the lock free
and take it: it overtakes everyone in the queue. Here `release` hands ownership
directly to the oldest live waiter (the lock never becomes free while anyone waits),
so a newcomer always queues behind. Timeouts and cancellation remove the waiter from
the queue, and a waiter cancelled in the instant ownership reached it passes the lock
on, so the queue stays consistent whatever happens.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable


class FifoLock:
    def __init__(self, on_wait: Callable[[float], None] | None = None):
        self._locked = False
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._on_wait = on_wait
        self.acquisitions = 0
        self.wait_seconds_total = 0.0

    def locked(self) -> bool:
        return self._locked

    @property
    def waiting(self) -> int:
        """Waiters still queued (cancelled ones are removed at once)."""
        return len(self._waiters)

    async def acquire(self, timeout: float | None = None) -> None:
        """Wait for the lock; raises TimeoutError after `timeout` seconds, never owning it then."""
        t0 = time.perf_counter()
        if not self._locked and not self._waiters:
            self._locked = True
            self._observe(t0)
            return
        if timeout is not None and timeout <= 0:
            raise TimeoutError("FIFO lock not acquired: no time left")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                # Ownership reached us just as we gave up: hand it on, as release would.
                self.release()
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise
        self._observe(t0)

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("FifoLock.release() on an unlocked lock")
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # direct handoff: the lock stays taken
                return
        self._locked = False

    def _observe(self, t0: float) -> None:
        waited = time.perf_counter() - t0
        self.acquisitions += 1
        self.wait_seconds_total += waited
        if self._on_wait is not None:
            self._on_wait(waited)

    async def __aenter__(self) -> FifoLock:
        await self.acquire()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()

"""Request bodies read in a burst, their heap given back to the kernel once the burst is over.

Read in small pieces, many bodies at once fragment the heap: 600 clients each sending 1 MB at
80 kB/s (reads of about 20 kB, each its own bytes object) took detect from 209 to 793 MiB,
and it stayed at 518 MiB after the attack (helper-55), since glibc keeps freed pages inside
its heap. A model call trims the heap after it (pipeline.scheduler), but those uploads were
refused before any model call. Here the bytes of bodies being read are counted as they are
read and let go when their request has been read whole or its connection is gone; once they
reached BURST_BYTES and fall to a tenth of that peak, the heap is trimmed (malloc_trim, on a
worker thread: tens of milliseconds), at most once every MIN_INTERVAL_S.

Event loop thread only; no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

BURST_BYTES = 64 * 2**20
MIN_INTERVAL_S = 5.0


class BodyBytes:
    """``later(delay, fn)``: how a trim put off for MIN_INTERVAL_S is run when it is due (the
    loop's call_later); without it, the next body let go after that runs it."""

    def __init__(self, on_burst_over: Callable[[], None] | None = None, burst_bytes: int = BURST_BYTES,
                 clock: Callable[[], float] = time.monotonic,
                 later: Callable[[float, Callable[[], None]], object] | None = None):
        self.on_burst_over, self.burst_bytes, self.clock, self.later = on_burst_over, burst_bytes, clock, later
        self.held = 0        # bytes of the bodies being read
        self.peak = 0        # the most held since the last trim
        self.trims = 0
        self._trimmed_at = float("-inf")
        self._put_off = False

    def read(self, n: int) -> None:
        self.held += n
        if self.held > self.peak:
            self.peak = self.held

    def let_go(self, n: int) -> None:
        self.held -= n
        if not self._burst_over():
            return
        wait = self._trimmed_at + MIN_INTERVAL_S - self.clock()
        if wait <= 0:
            self._trim()
        elif self.later is not None and not self._put_off:  # a burst over too soon after the last
            self._put_off = True
            self.later(wait, self._trim_if_over)

    def _trim_if_over(self) -> None:
        self._put_off = False
        if self._burst_over():
            self._trim()

    def _burst_over(self) -> bool:
        """The bodies read reached the burst size and fell to a tenth of their peak."""
        return self.peak >= self.burst_bytes and self.held * 10 <= self.peak

    def _trim(self) -> None:
        self.peak = self.held
        self._trimmed_at = self.clock()
        self.trims += 1
        if self.on_burst_over is not None:
            self.on_burst_over()

"""The main event loop's pulse, read by the probe listener's thread: /healthz fails when
the loop that serves clients has stopped turning, even though the probes are answered
from elsewhere."""

from __future__ import annotations

import asyncio
import time


class Heartbeat:
    """The main event loop's pulse: ``age()`` is how long since it last ran a callback."""

    PERIOD_S = 0.1

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        def beat() -> None:
            self._last = time.monotonic()
            self._handle = loop.call_later(self.PERIOD_S, beat)
        beat()

    def beat(self) -> None:
        """The loop runs now (called on it): a probe answered there, in the turn after a stall,
        before the timer's beat of that turn, must not read the stall as still going on."""
        self._last = time.monotonic()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def age(self) -> float:
        return time.monotonic() - self._last

    def problem(self, limit_s: float) -> str | None:
        """Why /healthz must fail (the loop has not run for ``limit_s``), or None."""
        stalled = self.age()
        return f"the event loop has not run for {stalled:.1f} s" if stalled > limit_s else None

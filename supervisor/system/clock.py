"""Time for the supervisor's policy, behind one small class that tests replace.

The real clock is the event loop's; a scripted clock (tests) moves only when told, so a
history of events and timeouts replays the same way every time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...
    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...
    async def sleep(self, delay: float) -> None: ...


class LoopClock:
    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay), fn)

    async def sleep(self, delay: float) -> None:
        await asyncio.sleep(max(0.0, delay))

"""The service's resident memory against its budget, watched while it serves.

The cost model charges what a request will hold before it runs; what it cannot see is memory
that stays: a model that keeps 100 MB of every call grew to 1 285 MiB against a 600 MiB budget
with no 503, no failing probe and no log line (helper-46). Every PERIOD_S the resident size
is read (off the event loop) and compared with the service's budget: over it, a warning
(at most every WARN_EVERY_S, saying by how much), `onecard_memory_over_budget` 1, and /stats
says so. Requests are still served and health does not fail: the memory may come back (a big
batch's arena), and the orchestrator's memory limit, not this process, decides on a kill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from common import hostmemory

log = logging.getLogger("onecard.service")

PERIOD_S = 2.0
WARN_EVERY_S = 60.0
MIB = 2**20


class MemoryWatch:
    def __init__(self, name: str, budget_bytes: Callable[[], int | None], gauge: Any,
                 read_resident: Callable[[], int | None] = hostmemory.resident_bytes):
        self.name, self.budget_bytes, self.gauge, self.read_resident = name, budget_bytes, gauge, read_resident
        self.resident: int | None = None
        self.over = False
        self._warned_at = float("-inf")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="onecard-memory-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                self.look(await asyncio.to_thread(self.read_resident))
            except Exception:  # noqa: BLE001 - a figure: never the end of the watch
                log.exception("%s: reading the resident memory failed", self.name)
            await asyncio.sleep(PERIOD_S)

    def look(self, resident: int | None, now: float | None = None) -> None:
        budget = self.budget_bytes()
        self.resident = resident
        self.over = resident is not None and budget is not None and resident > budget
        self.gauge.set(1 if self.over else 0)
        now = time.monotonic() if now is None else now
        if self.over and now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("%s: resident memory %.0f MiB is over this service's budget of %.0f MiB (by %.0f MiB): "
                        "memory the model keeps between calls, or a cost it does not charge; requests are still "
                        "served", self.name, resident / MIB, budget / MIB, (resident - budget) / MIB)

    def snapshot(self) -> dict[str, Any]:
        return {"resident_bytes": self.resident, "over_budget": self.over}

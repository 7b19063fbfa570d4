"""Keeps this unit's models in the queue's registry, and notices a queue that lost its data.

Every ``announce_period_s`` the unit puts back what it announces of each local model when
the registry misses it or holds something else (a Redis restarted without persistence, a
flush, an operator's mistake): an API-only unit would otherwise answer every submit of that
model 422 until each consuming unit restarted. The same call reads the queue's epoch
marker; another value than the one this unit saw before means the queue lost its data
(every job it held): said in the log, on /stats and /metrics, and in /info.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.jobs.broker import Broker, ModelInfo, QueueUnavailable
from services.jobs.metrics import JobsMetrics

log = logging.getLogger("onecard.jobs")


class Registry:
    def __init__(self, broker: Broker, models: Callable[[], list[ModelInfo]], metrics: JobsMetrics,
                 period_s: float):
        self.broker, self.models, self.metrics, self.period_s = broker, models, metrics, period_s
        self.epoch: str | None = None
        self.data_lost_at: float | None = None
        self.data_losses = 0
        self._task: asyncio.Task | None = None

    async def check(self) -> None:
        """One round: announce what is missing, compare the epoch. Raises QueueUnavailable."""
        for info in self.models():
            if await self.broker.announce(info) and self.epoch is not None:
                self.metrics.count_registry("reannounced")
                log.warning("jobs: the queue's registry had lost %s; announced again", info.label)
        epoch = await self.broker.epoch()
        if epoch is None:
            return
        if self.epoch is not None and epoch != self.epoch:
            self.data_losses += 1
            self.data_lost_at = time.time()
            self.metrics.count_registry("data_lost")
            log.error("jobs: the queue lost its data (its marker changed: Redis restarted without persistence, or "
                      "was flushed): the jobs it held are gone; models announced again. Run Redis with "
                      "appendonly yes and appendfsync always")
        self.epoch = epoch

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="jobs-registry")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.check()
            except QueueUnavailable as exc:
                log.debug("jobs: registry check postponed: %s", exc)
            except Exception:  # noqa: BLE001 - the loop outlives any one failure
                log.exception("jobs: registry check failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def describe(self) -> dict:
        return {"epoch": self.epoch, "data_losses": self.data_losses, "data_lost_at": self.data_lost_at}

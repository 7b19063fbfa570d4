"""A model backend that records what it is given and whose call waits on a gate, and the
scheduler around it: the scheduler and admission tests decide exactly what is queued when
the model frees up. Each helper stands in for the runtime's real backend (the integration
tests run the real ones)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.queued import QueuedRequest
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.pipeline.timing import Timing


@dataclass(eq=False)
class Item:
    name: str
    payload: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))  # compares badly by value
    cancel: threading.Event | None = None
    fail: bool = False


class Recorder(Backend):
    name = "recorder"
    supports_batching = True

    def __init__(self):
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.raise_on_batch: str | None = None
        self.freed = 0

    def load(self) -> None:
        pass

    def infer_batch(self, items):
        self.batches.append([i.name for i in items])
        self.entered.set()
        self.gate.wait(5)
        if self.raise_on_batch and len(items) > 1 and any(i.name == self.raise_on_batch for i in items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return [ValueError(f"{i.name} bad") if i.fail else f"out:{i.name}" for i in items]

    def on_out_of_memory(self):
        self.freed += 1


def scheduler(**settings) -> tuple[Scheduler, Recorder]:
    backend = Recorder()
    cfg = ModelServiceSettings(**{"max_batch_size": 3, "batch_policy": "fixed", **settings})
    sched = Scheduler(backend, cfg, PipelineMetrics())
    sched.start()
    return sched, backend


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Client:
    """An ASGI receive that reports a disconnect when told to."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def until(cond, what="condition"):
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} not reached")


async def hold(sched: Scheduler, backend: Recorder) -> asyncio.Task:
    """Put a blocker on the model and keep it there until backend.gate is set."""
    backend.gate.clear()
    backend.entered.clear()
    task = asyncio.ensure_future(sched.submit([Item("blocker")], "hold", Timing(), None))
    await until(backend.entered.is_set, "blocker on the model")
    return task


def dropped(sched: Scheduler, reason: str) -> float:
    return sched.metrics.registry.get_sample_value("onecard_dropped_total", {"reason": reason}) or 0.0


def stale_job(loop, name: str, key, age: float = 100.0) -> QueuedRequest:
    """A job that arrived `age` seconds ago with a 1 s deadline: long expired, no waiter."""
    t0 = time.perf_counter() - age
    job = QueuedRequest([Item(name)], key, t0 + 1, t0, loop.create_future())
    job.results, job.remaining = [None], 1
    return job


class SizedRecorder(Recorder):
    def item_pixels(self, item) -> int:
        return 1000


def auto_scheduler(a: float, b: float, max_batch: int = 4, backend: Recorder | None = None,
                   **settings) -> tuple[Scheduler, Recorder]:
    backend = backend or Recorder()
    sched = Scheduler(backend, ModelServiceSettings(max_batch_size=max_batch, **settings), PipelineMetrics())
    for size in range(1, max_batch + 1):
        sched.cost.curve.replace(size, a + b * (size - 1))
    sched.start()
    return sched, backend

"""The scheduler with the auto batching policy: what it does with requests still decoding,
with a model whose cost is sub-linear or linear, and with calls that do not fit in memory.
Assertions are on the batches the model saw, never on durations."""

from __future__ import annotations

import asyncio

from services.runtime.pipeline.timing import Timing
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from tests.unit.test_scheduler import Item, Recorder, run, until


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


def test_an_idle_model_waits_for_requests_still_decoding_when_its_cost_is_sub_linear():
    async def main():
        sched, backend = auto_scheduler(0.6, 0.06)
        tokens = [object(), object()]
        for token in tokens:
            sched.decoding_started(token)
        first = asyncio.ensure_future(sched.submit([Item("a")], "k", Timing(), None))
        await asyncio.sleep(0.01)
        others = []
        for name, token in zip("bc", tokens):
            sched.decoding_done(token)
            others.append(asyncio.ensure_future(sched.submit([Item(name)], "k", Timing(), None)))
        await asyncio.gather(first, *others)
        stats = sched.batching_stats()
        await sched.stop()
        return backend.batches, stats

    batches, stats = run(main())
    assert batches == [["a", "b", "c"]]
    assert stats["waited_s"] > 0 and stats["batches"] == 1 and stats["mean_batch_size"] == 3


def test_a_model_whose_cost_is_linear_starts_at_once_even_with_requests_decoding():
    async def main():
        sched, backend = auto_scheduler(0.05, 0.05)
        token = object()
        sched.decoding_started(token)
        first = asyncio.ensure_future(sched.submit([Item("a")], "k", Timing(), None))
        await until(lambda: backend.batches)
        sched.decoding_done(token)
        second = await sched.submit([Item("b")], "k", Timing(), None)
        await first
        stats = sched.batching_stats()
        await sched.stop()
        return backend.batches, second, stats

    batches, second, stats = run(main())
    assert batches == [["a"], ["b"]] and second == ["out:b"] and stats["waited_s"] == 0


def test_the_oldest_request_still_leads_and_a_wait_never_outlasts_max_wait_ms():
    """A decode that never ends (its client stalls) cannot hold the head past the cap."""
    async def main():
        sched, backend = auto_scheduler(0.6, 0.06, max_wait_ms=30)
        sched.decoding_started(object())  # never done
        out = await sched.submit([Item("a")], "k", Timing(), None)
        stats = sched.batching_stats()
        await sched.stop()
        return backend.batches, out, stats

    batches, out, stats = run(main())
    assert batches == [["a"]] and out == ["out:a"] and 0 < stats["waited_s"]


def test_a_batch_is_formed_to_fit_the_call_memory_budget_and_splits_a_request():
    """Items that together would pass a call's working memory go to separate calls, in order."""
    from services.runtime.pipeline.budgets import plan_budgets

    async def main():
        sched, backend = auto_scheduler(0.05, 0.05, backend=SizedRecorder())
        sched.cost.memory.fit([(0, 0), (1000, 100_000)])          # 100 bytes a pixel
        sched.cost.budgets = plan_budgets(10**9, 0, batch_bytes=300_000)
        backend.gate.clear()
        blocker = asyncio.ensure_future(sched.submit([Item("blocker")], "k", Timing(), None))
        await until(lambda: backend.entered.is_set())
        big = [Item(f"m{i}") for i in range(5)]
        task = asyncio.ensure_future(sched.submit(big, "k", Timing(), None))
        await until(lambda: sched.pending_items == 5)
        backend.gate.set()
        await asyncio.gather(blocker, task)
        await sched.stop()
        return backend.batches

    batches = run(main())
    # 100 B/px x 1000 px x margin 1.25 = 125 kB an item: two fit in 300 kB, three do not
    assert batches == [["blocker"], ["m0", "m1"], ["m2", "m3"], ["m4"]]

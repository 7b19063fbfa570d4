"""How batches are formed: the oldest request first and the compatible items behind it in
arrival order (nothing starved), a request's items split across calls and answered in
order, the fill window of the fixed policy, the auto policy's waits (only for a sub-linear
cost, never past max_wait_ms), and batches sized to the call's memory budget."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.pipeline.timing import Timing
from tests.fakes.model_backend import Item, Recorder, SizedRecorder, auto_scheduler, hold, run, scheduler, until


def test_batches_start_with_the_oldest_and_take_compatible_items_in_order():
    async def main():
        sched, backend = scheduler()
        blocker = await hold(sched, backend)
        tasks = []
        for name in ["a1", "b1", "a2", "a3", "b2", "a4", "b3", "a5"]:
            tasks.append(asyncio.ensure_future(sched.submit([Item(name)], name[0], Timing(), None)))
            await asyncio.sleep(0)
        await until(lambda: sched.pending_items == 8, "all queued")
        backend.gate.set()
        results = await asyncio.gather(blocker, *tasks)
        await sched.stop()
        return backend.batches[1:], results

    batches, results = run(main())
    assert batches == [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["a4", "a5"]]
    assert [r[0] for r in results[1:]] == [f"out:{n}" for n in ["a1", "b1", "a2", "a3", "b2", "a4", "b3", "a5"]]


def test_a_multi_item_request_is_split_across_batches_and_answered_in_order():
    async def main():
        sched, backend = scheduler(max_batch_size=2)
        out = await sched.submit([Item("m0"), Item("m1"), Item("m2")], None, Timing(), None)
        await sched.stop()
        return backend.batches, out

    batches, out = run(main())
    assert batches == [["m0", "m1"], ["m2"]] and out == ["out:m0", "out:m1", "out:m2"]


def test_a_request_split_across_batches_counts_the_model_time_of_each():
    async def main():
        sched, backend = scheduler(max_batch_size=1)

        def slow(items):
            time.sleep(0.1)
            return [f"out:{i}" for i in items]
        backend.infer_batch = slow
        timing = Timing()
        out = await sched.submit(["p0", "p1", "p2"], None, timing, None)  # plain payloads: no cancel event
        await sched.stop()
        return out, timing.stages

    out, stages = run(main())
    assert out == ["out:p0", "out:p1", "out:p2"] and 0.28 < stages["infer"] < 2


# ---- batching --------------------------------------------------------------------------------
def test_a_backend_that_cannot_batch_gets_one_item_per_call():
    async def main():
        backend = Recorder()
        backend.supports_batching = False
        sched = Scheduler(backend, ModelServiceSettings(max_batch_size=4), PipelineMetrics())
        sched.start()
        blocker = await hold(sched, backend)
        tasks = [asyncio.ensure_future(sched.submit([Item(n)], "k", Timing(), None)) for n in "abc"]
        await until(lambda: sched.pending_items == 3)
        backend.gate.set()
        await asyncio.gather(blocker, *tasks)
        await sched.stop()
        return sched.batching, backend.batches

    batching, batches = run(main())
    assert batching is False and batches == [["blocker"], ["a"], ["b"], ["c"]]


@pytest.mark.parametrize("max_batch", [2, 3])
def test_an_idle_model_waits_up_to_max_wait_ms_for_a_batch_to_fill(max_batch):
    async def main():
        sched, backend = scheduler(max_batch_size=max_batch, max_wait_ms=500)
        t0 = time.perf_counter()
        first = asyncio.ensure_future(sched.submit([Item("a")], "k", Timing(), None))
        await asyncio.sleep(0.05)  # the model is idle, yet "a" waits for company
        second = asyncio.ensure_future(sched.submit([Item("b")], "k", Timing(), None))
        await asyncio.gather(first, second)
        took = time.perf_counter() - t0
        await sched.stop()
        return backend.batches, took

    batches, took = run(main())
    if max_batch == 2:  # full at once: no more waiting
        assert batches == [["a", "b"]] and took < 0.4
    else:               # not full: runs when the window, counted from "a"'s arrival, ends
        assert batches == [["a", "b"]] and 0.48 < took < 2


def test_a_lone_item_runs_when_its_fill_window_ends():
    async def main():
        sched, backend = scheduler(max_batch_size=4, max_wait_ms=100)
        t0 = time.perf_counter()
        await sched.submit([Item("a")], "k", Timing(), None)
        took = time.perf_counter() - t0
        out = await sched.submit([Item("b")], "k", Timing(), None)  # the loop is still serving
        await sched.stop()
        return took, out

    took, out = run(main())
    assert 0.09 < took < 0.6 and out == ["out:b"]


def test_an_item_that_waited_longer_than_the_window_behind_a_busy_model_runs_at_once():
    """The fill window counts from the head's arrival, not from when the model frees up."""
    async def main():
        sched, backend = scheduler(max_batch_size=3, max_wait_ms=400)
        blocker = await hold(sched, backend)
        task = asyncio.ensure_future(sched.submit([Item("a")], "k", Timing(), None))
        await asyncio.sleep(0.45)  # longer than the window
        t0 = time.perf_counter()
        backend.gate.set()
        await asyncio.gather(blocker, task)
        took = time.perf_counter() - t0
        out = await sched.submit([Item("b")], "k", Timing(), None)  # the loop still serves
        await sched.stop()
        return took, backend.batches, out

    took, batches, out = run(main())
    assert batches[:2] == [["blocker"], ["a"]] and took < 0.3 and out == ["out:b"]


def test_without_batching_or_max_wait_an_idle_model_starts_at_once():
    async def main():
        took = []
        for settings in ({"max_batch_size": 1, "max_wait_ms": 500}, {"max_batch_size": 4, "max_wait_ms": 0}):
            sched, backend = scheduler(**settings)
            t0 = time.perf_counter()
            await sched.submit([Item("a")], "k", Timing(), None)
            took.append(time.perf_counter() - t0)
            await sched.stop()
        return took

    assert all(t < 0.3 for t in run(main()))


def test_an_idle_model_waits_for_requests_still_decoding_when_its_cost_is_sub_linear():
    async def main():
        sched, backend = auto_scheduler(0.6, 0.06)
        tokens = [object(), object()]
        for token in tokens:
            sched.decoding_started(token)
        first = asyncio.ensure_future(sched.submit([Item("a")], "k", Timing(), None))
        await asyncio.sleep(0.01)
        others = []
        for name, token in zip("bc", tokens, strict=True):
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


def test_the_last_batch_is_not_kept_alive_once_answered():
    """The batch loop waits for the next request with nothing of the last one bound: a big
    picture and its answer stayed in memory until the next request (for good when idle)."""
    import gc
    import weakref

    async def main():
        sched, backend = scheduler()
        items = [Item(f"x{k}") for k in range(3)]
        refs = [weakref.ref(i) for i in items]
        out = await sched.submit(items, "k", Timing(), None)
        del items
        await asyncio.sleep(0.05)  # the loop is back waiting for work
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        await sched.stop()
        return out, alive

    out, alive = run(main())
    assert out == ["out:x0", "out:x1", "out:x2"] and alive == []


def test_a_failed_call_frees_its_pictures_without_waiting_for_a_full_collection():
    """The failure is raised on with its traceback, whose frames held the batch, the model's
    own buffers and the job (which holds the failure): a cycle, so a failed request's pictures
    stayed until the cyclic collector's next full pass (minutes on an idle service). Checked
    with the collector off: reference counts alone must free them. The traceback still names
    the model's line, for the log."""
    import gc
    import traceback
    import weakref

    class Buffer:  # what a model holds mid-call (a tensor)
        pass

    async def main():
        sched, backend = scheduler()
        buffers = []

        def failing(items):
            held = [Buffer() for _ in items]
            buffers.extend(weakref.ref(b) for b in held)
            raise RuntimeError("the model broke")
        backend.infer_batch = failing
        items = [Item(f"x{k}") for k in range(2)]
        refs = [weakref.ref(i) for i in items]
        try:
            await sched.submit(items, "k", Timing(), None)
        except RuntimeError as exc:
            where = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        del items
        await asyncio.sleep(0.05)  # the loop is back waiting for work
        alive = sum(r() is not None for r in refs + buffers)
        await sched.stop()
        return where, alive, len(buffers)

    gc.disable()
    try:
        where, alive, made = run(main())
    finally:
        gc.enable()
    assert "failing" in where and made >= 2 and alive == 0


def test_a_failed_call_of_an_abandoned_request_frees_its_pictures():
    """Nobody raises the failure of a request abandoned mid-call: it stays in the job's
    results, and its traceback held the call's frame, which holds the results (a cycle) and
    the batch. Reference counts alone must free them (the collector is off)."""
    import gc
    import weakref

    async def main():
        sched, backend = scheduler()
        backend.gate.clear()
        real = backend.infer_batch

        def failing(items):
            real(items)  # waits on the gate
            raise RuntimeError("the model broke")
        backend.infer_batch = failing
        items = [Item("x0")]
        refs = [weakref.ref(i) for i in items]
        task = asyncio.ensure_future(sched.submit(items, "k", Timing(), None))
        del items
        await asyncio.get_running_loop().run_in_executor(None, backend.entered.wait, 5)
        task.cancel()  # the request goes while its call runs
        await asyncio.gather(task, return_exceptions=True)
        del task  # (a cancelled task keeps its CancelledError, whose frames hold the items)
        backend.gate.set()
        await asyncio.sleep(0.1)  # the call has failed, the loop is back waiting for work
        alive = sum(r() is not None for r in refs)
        await sched.stop()
        return alive, backend.batches

    gc.disable()
    try:
        alive, batches = run(main())
    finally:
        gc.enable()
    assert batches == [["x0"]] and alive == 0

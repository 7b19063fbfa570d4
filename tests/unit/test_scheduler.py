"""The scheduler's and admission's policy, in-process: batch formation (oldest first,
compatible items behind it, nothing starved), deadlines, drops, cancellation, failures.
The backend is a recorder whose model call waits on a gate, so tests decide exactly what
is queued when the model frees up."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from services.runtime.pipeline.admission import Admission
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.timing import Timing
from services.runtime.errors import ApiError, ClientGone
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings


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


def test_a_request_past_its_deadline_before_starting_gets_504_and_never_runs():
    async def main():
        sched, backend = scheduler(request_timeout_s=0.2)
        blocker = await hold(sched, backend)
        late = asyncio.ensure_future(sched.submit([Item("late")], "hold", Timing(), None))
        with pytest.raises(ApiError) as err:
            await late
        backend.gate.set()
        await blocker
        await asyncio.sleep(0.05)
        await sched.stop()
        return backend.batches, err.value

    batches, err = run(main())
    assert err.status == 504 and ["late"] not in batches and all("late" not in b for b in batches)


def test_the_batch_loop_does_not_start_an_expired_job_even_before_its_waiter_notices():
    async def main():
        sched, backend = scheduler(request_timeout_s=0.05)
        blocker = await hold(sched, backend)
        timing = Timing()
        timing.t0 -= 10  # arrived long ago: expired at once
        loop = asyncio.get_running_loop()
        # enqueue without a waiter (as if its timer had not fired yet)
        from services.runtime.pipeline.scheduler import Job, _Entry
        job = Job([Item("stale")], "hold", timing.t0 + 0.05, timing.t0, loop.create_future())
        job.results, job.remaining = [None], 1
        sched._pending.append(_Entry(job, 0))
        backend.gate.set()
        await blocker
        with pytest.raises(ApiError) as err:
            await job.future
        await sched.stop()
        return backend.batches, err.value

    batches, err = run(main())
    assert err.status == 504 and all("stale" not in b for b in batches)


def test_a_client_leaving_while_queued_is_out_of_the_queue_at_once():
    async def main():
        sched, backend = scheduler(max_batch_size=1)
        blocker = await hold(sched, backend)
        ahead = asyncio.ensure_future(sched.submit([Item("ahead")], None, Timing(), None))
        client = Client()
        quitter = asyncio.ensure_future(sched.submit([Item("quitter")], None, Timing(), client.receive))
        await until(lambda: sched.pending_items == 2, "both queued")
        client.gone.set()
        with pytest.raises(ClientGone):
            await quitter
        pending_after = sched.pending_items
        backend.gate.set()
        await asyncio.gather(blocker, ahead)
        await sched.stop()
        return pending_after, backend.batches

    pending_after, batches = run(main())
    assert pending_after == 1 and batches == [["blocker"], ["ahead"]]


def test_a_running_cancellable_job_is_told_to_stop_at_its_deadline():
    async def main():
        sched, backend = scheduler(request_timeout_s=0.3)
        backend.gate.clear()
        item = Item("long", cancel=threading.Event())
        task = asyncio.ensure_future(sched.submit([item], None, Timing(), None))
        with pytest.raises(ApiError) as err:
            await task
        stopped = item.cancel.is_set()
        backend.gate.set()
        await asyncio.sleep(0.05)
        await sched.stop()
        return err.value, stopped

    err, stopped = run(main())
    assert err.status == 504 and "stopped" in err.message and stopped


def test_a_running_job_that_cannot_stop_midway_is_waited_for_past_its_deadline():
    async def main():
        sched, backend = scheduler(request_timeout_s=0.2)
        backend.gate.clear()
        task = asyncio.ensure_future(sched.submit([Item("short")], None, Timing(), None))
        await until(backend.entered.is_set)
        await asyncio.sleep(0.4)  # past the deadline, still running
        backend.gate.set()
        out = await task
        await sched.stop()
        return out

    assert run(main()) == ["out:short"]


def test_a_bad_item_fails_alone_and_a_raising_batch_is_retried_item_by_item():
    async def main():
        sched, backend = scheduler()
        backend.raise_on_batch = "x2"
        blocker = await hold(sched, backend)
        tasks = [asyncio.ensure_future(sched.submit([Item(n, fail=(n == "x3"))], None, Timing(), None))
                 for n in ("x1", "x2", "x3")]
        await until(lambda: sched.pending_items == 3)
        backend.gate.set()
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
        await sched.stop()
        return backend.batches[1:], results[1:], backend.freed

    batches, results, freed = run(main())
    assert batches == [["x1", "x2", "x3"], ["x1"], ["x2"], ["x3"]]
    assert results[0] == ["out:x1"] and results[1] == ["out:x2"]
    assert isinstance(results[2], ValueError)
    assert freed == 1  # the out-of-memory batch freed memory once


def test_out_of_memory_alone_is_a_503():
    async def main():
        sched, backend = scheduler()

        def oom(items):
            raise RuntimeError("CUDA out of memory")
        backend.infer_batch = oom
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("big")], None, Timing(), None)
        await sched.stop()
        return err.value, backend.freed

    err, freed = run(main())
    assert (err.status, err.code) == (503, "out_of_memory") and freed == 1


def test_admission_counts_a_request_on_arrival_and_bounds_the_waiting():
    a = Admission(max_queue=2, retry_after_s=3)
    t1, t2 = a.admit(), a.admit()
    with pytest.raises(ApiError) as err:
        a.admit()
    assert (err.value.status, err.value.code) == (503, "overloaded") and err.value.headers == {"Retry-After": "3"}
    assert err.value.message == "2 requests are already waiting (max_queue 2)"
    t1.started()
    assert (a.waiting, a.running) == (1, 1)
    a.admit()  # a slot freed as t1 left the queue for the model
    with pytest.raises(ApiError):
        a.admit()
    t1.release()
    t1.release()  # idempotent
    t2.release()
    assert (a.waiting, a.running, a.refused) == (1, 0, 2)


def test_admission_with_max_queue_zero_admits_only_to_an_idle_model():
    a = Admission(max_queue=0, retry_after_s=1)
    t = a.admit()
    with pytest.raises(ApiError):
        a.admit()  # one already heading to the model
    t.started()
    with pytest.raises(ApiError):
        a.admit()  # the model is busy: no waiting allowed
    t.release()
    a.admit()


def test_an_expired_item_behind_the_head_does_not_join_the_batch():
    async def main():
        sched, backend = scheduler(request_timeout_s=30)
        blocker = await hold(sched, backend)
        fresh = asyncio.ensure_future(sched.submit([Item("fresh")], "k", Timing(), None))
        await until(lambda: sched.pending_items == 1)
        from services.runtime.pipeline.scheduler import Job, _Entry
        loop = asyncio.get_running_loop()
        old = Timing()
        old.t0 -= 100
        stale = Job([Item("stale")], "k", old.t0 + 1, old.t0, loop.create_future())
        stale.results, stale.remaining = [None], 1
        sched._pending.append(_Entry(stale, 0))  # compatible, behind the head, long expired
        backend.gate.set()
        await asyncio.gather(blocker, fresh)
        await asyncio.sleep(0.05)
        await sched.stop()
        return backend.batches

    batches = run(main())
    assert batches[1] == ["fresh"] and all("stale" not in b for b in batches)


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


def test_a_failing_batch_of_plain_payloads_is_retried_one_by_one():
    async def main():
        sched, backend = scheduler()
        calls, gate, entered = [], threading.Event(), threading.Event()

        def infer(items):
            calls.append(list(items))
            entered.set()
            gate.wait(5)
            if len(items) > 1:
                raise RuntimeError("a bad batch")
            return [f"out:{i}" for i in items]
        backend.infer_batch = infer
        try:
            blocker = asyncio.ensure_future(sched.submit(["p0"], None, Timing(), None))
            await until(entered.is_set)
            tasks = [asyncio.ensure_future(sched.submit([p], None, Timing(), None)) for p in ("p1", "p2")]
            await until(lambda: sched.pending_items == 2)
        finally:
            gate.set()
        results = await asyncio.gather(blocker, *tasks)
        await sched.stop()
        return calls, results

    calls, results = run(main())
    assert calls == [["p0"], ["p1", "p2"], ["p1"], ["p2"]] and results == [["out:p0"], ["out:p1"], ["out:p2"]]


def test_admission_states_and_counts_move_together():
    a = Admission(max_queue=5, retry_after_s=1)
    tickets = [a.admit() for _ in range(3)]
    assert [t.state for t in tickets] == ["waiting"] * 3
    tickets[0].started()
    tickets[1].started()
    tickets[0].started()  # twice: counted once
    assert (a.waiting, a.running) == (1, 2) and tickets[0].state == "running"
    tickets[2].release()
    assert (a.waiting, a.running, tickets[2].state) == (0, 2, "done")
    tickets[2].started()  # a released ticket never starts
    assert (a.waiting, a.running) == (0, 2)
    tickets[0].release()
    assert (a.waiting, a.running, tickets[0].state) == (0, 1, "done")


def test_admission_with_max_queue_one_queues_one_behind_a_running_request():
    a = Admission(max_queue=1, retry_after_s=2)
    a.admit().started()
    a.admit()  # one may wait while the model is busy
    with pytest.raises(ApiError) as err:
        a.admit()
    assert (err.value.status, err.value.code) == (503, "overloaded")
    assert err.value.message == "1 requests are already waiting (max_queue 1)"
    assert err.value.headers == {"Retry-After": "2"} and a.refused == 1

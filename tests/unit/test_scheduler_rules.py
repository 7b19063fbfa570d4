"""The scheduler's rules that test_scheduler.py leaves implicit, each one found by a mutant
that survived (docs/mutation-testing.md): the fill window, the error envelopes and drop
reasons, what happens to an abandoned or expired job's other items, the stage times.
The GPU worker, health and out-of-memory rules are in test_scheduler_worker_rules.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.runtime.pipeline.admission import Admission
from services.runtime.pipeline.timing import Timing
from services.runtime.errors import ApiError, ClientGone
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.scheduler import Job, Scheduler, _Entry
from services.runtime.pipeline.settings import ModelServiceSettings
from tests.unit.test_scheduler import Client, Item, Recorder, hold, run, scheduler, until


def dropped(sched: Scheduler, reason: str) -> float:
    return sched.metrics.registry.get_sample_value("onecard_dropped_total", {"reason": reason}) or 0.0


def stale_job(loop, name: str, key, age: float = 100.0) -> Job:
    """A job that arrived `age` seconds ago with a 1 s deadline: long expired, no waiter."""
    t0 = time.perf_counter() - age
    job = Job([Item(name)], key, t0 + 1, t0, loop.create_future())
    job.results, job.remaining = [None], 1
    return job


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


def test_an_abandoned_started_job_at_the_head_lets_the_next_one_lead():
    """A started multi-item job whose client left keeps entries in the queue; the batch
    after it starts with the oldest live job, not with the abandoned job's key."""
    async def main():
        sched, backend = scheduler(max_batch_size=1)
        backend.gate.clear()
        client = Client()
        quitter = asyncio.ensure_future(
            sched.submit([Item("q0"), Item("q1"), Item("q2")], "a", Timing(), client.receive))
        await until(backend.entered.is_set)
        b = asyncio.ensure_future(sched.submit([Item("b")], "b", Timing(), None))
        c = asyncio.ensure_future(sched.submit([Item("c")], "a", Timing(), None))
        await until(lambda: sched.pending_items == 4)
        client.gone.set()
        with pytest.raises(ClientGone):
            await quitter
        backend.gate.set()
        await asyncio.gather(b, c)
        await asyncio.sleep(0.02)
        await sched.stop()
        return backend.batches, dropped(sched, "client_gone"), sched.pending_items

    batches, gone, pending = run(main())
    assert batches == [["q0"], ["b"], ["c"]]  # q1, q2 never run; b was first in line
    assert gone == 1 and pending == 0


def test_expired_jobs_at_the_head_are_all_dropped_before_the_batch_key_is_chosen():
    async def main():
        sched, backend = scheduler(max_batch_size=3)
        blocker = await hold(sched, backend)
        loop = asyncio.get_running_loop()
        stale = [stale_job(loop, "s1", "x"), stale_job(loop, "s2", "a")]
        for job in stale:
            sched._pending.append(_Entry(job, 0))
        b = asyncio.ensure_future(sched.submit([Item("b")], "b", Timing(), None))
        await asyncio.sleep(0)
        a = asyncio.ensure_future(sched.submit([Item("a")], "a", Timing(), None))
        await until(lambda: sched.pending_items == 4)
        backend.gate.set()
        await asyncio.gather(blocker, a, b)
        errors = []
        for job in stale:
            with pytest.raises(ApiError) as err:
                await job.future
            errors.append(err.value)
        await sched.stop()
        return backend.batches, errors, dropped(sched, "deadline")

    batches, errors, expired = run(main())
    assert batches == [["blocker"], ["b"], ["a"]]
    for err in errors:
        assert (err.status, err.code) == (504, "deadline_exceeded")
        assert err.message == "not started within the request deadline of 30 s"
    assert expired == 2


# ---- deadlines, clients, shutdown --------------------------------------------------------------
def test_the_two_deadline_504s_their_messages_and_drop_reasons():
    async def main():
        sched, backend = scheduler(request_timeout_s=0.25)
        blocker = await hold(sched, backend)
        t0 = time.perf_counter()
        with pytest.raises(ApiError) as queued:
            await sched.submit([Item("late")], "k", Timing(), Client().receive)  # a client that stays
        waited = time.perf_counter() - t0
        backend.gate.set()
        await blocker
        backend.gate.clear()
        item = Item("long", cancel=threading.Event())
        with pytest.raises(ApiError) as running:
            await sched.submit([item], "k", Timing(), None)
        backend.gate.set()
        await sched.stop()
        return queued.value, waited, running.value, dropped(sched, "deadline")

    queued, waited, running, count = run(main())
    assert (queued.status, queued.code) == (504, "deadline_exceeded")
    assert queued.message == "not started within the request deadline of 0.25 s"
    assert (running.status, running.code) == (504, "deadline_exceeded")
    assert running.message == "stopped at the request deadline of 0.25 s"
    assert 0.2 < waited < 0.7 and count == 2


def test_a_client_leaving_while_its_uncancellable_call_runs_past_the_deadline_is_noticed():
    async def main():
        sched, backend = scheduler(request_timeout_s=0.1)
        backend.gate.clear()
        client = Client()
        task = asyncio.ensure_future(sched.submit([Item("short")], "k", Timing(), client.receive))
        await until(backend.entered.is_set)
        await asyncio.sleep(0.2)  # past the deadline; the call cannot stop, so it is waited for
        client.gone.set()
        try:
            with pytest.raises(ClientGone):
                await asyncio.wait_for(task, 2)
            still_running = not backend.gate.is_set()
        finally:
            backend.gate.set()
        await sched.stop()
        return still_running, dropped(sched, "client_gone")

    assert run(main()) == (True, 1)


def test_a_receive_that_reports_other_messages_is_not_a_disconnect():
    async def main():
        sched, backend = scheduler()
        backend.gate.clear()
        messages = 0

        async def receive():
            nonlocal messages
            messages += 1
            if messages <= 3:
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.Event().wait()

        task = asyncio.ensure_future(sched.submit([Item("x")], "k", Timing(), receive))
        await until(lambda: messages > 3)
        backend.gate.set()
        out = await task
        await sched.stop()
        return out, messages

    out, messages = run(main())
    assert out == ["out:x"] and messages == 4


def test_a_request_cancelled_by_shutdown_leaves_the_queue_and_is_counted():
    async def main():
        sched, backend = scheduler()
        blocker = await hold(sched, backend)
        item = Item("queued", cancel=threading.Event())
        task = asyncio.ensure_future(sched.submit([item], "k", Timing(), None))
        await until(lambda: sched.pending_items == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pending = sched.pending_items
        backend.gate.set()
        await blocker
        await asyncio.sleep(0.02)
        await sched.stop()
        return pending, item.cancel.is_set(), backend.batches, dropped(sched, "shutdown")

    pending, told, batches, count = run(main())
    assert pending == 0 and told and batches == [["blocker"]] and count == 1


def test_abandoning_items_without_a_cancel_event_works_and_counts_once():
    async def main():
        sched, backend = scheduler()
        blocker = await hold(sched, backend)
        client = Client()
        task = asyncio.ensure_future(sched.submit(["plain", "strings"], "k", Timing(), client.receive))
        await until(lambda: sched.pending_items == 2)
        client.gone.set()
        with pytest.raises(ClientGone):
            await task
        backend.gate.set()
        await blocker
        await sched.stop()
        return dropped(sched, "client_gone"), sched.pending_items

    assert run(main()) == (1, 0)


# ---- the admission ticket, stage times, in-flight ---------------------------------------------
def test_the_ticket_moves_to_running_when_the_model_takes_the_request():
    async def main():
        sched, backend = scheduler()
        admission = Admission(max_queue=4, retry_after_s=1)
        ticket = admission.admit()
        backend.gate.clear()
        task = asyncio.ensure_future(sched.submit([Item("a"), Item("b")], "k", Timing(), None, ticket))
        await until(backend.entered.is_set)
        during = (ticket.state, admission.waiting, admission.running, sched.in_flight,
                  sched.metrics.registry.get_sample_value("onecard_in_flight"))
        backend.gate.set()
        await task
        after = (sched.in_flight, sched.metrics.registry.get_sample_value("onecard_in_flight"))
        await sched.stop()
        return during, after

    during, after = run(main())
    assert during == ("running", 0, 1, 2, 2.0) and after == (0, 0.0)


def test_stage_times_report_the_queue_wait_and_the_model_time():
    async def main():
        sched, backend = scheduler()
        blocker = await hold(sched, backend)
        timing = Timing()
        task = asyncio.ensure_future(sched.submit([Item("a")], "k", timing, None))
        await asyncio.sleep(0.15)  # "a" waits behind the blocker
        backend.gate.set()
        await asyncio.gather(blocker, task)
        await sched.stop()
        return timing.stages

    stages = run(main())
    assert set(stages) == {"queue", "infer"} and 0.12 < stages["queue"] < 2 and 0 <= stages["infer"] < 0.5


def test_a_slow_call_counts_as_model_time_not_queue_time():
    async def main():
        sched, backend = scheduler()
        backend.gate.clear()
        timing = Timing()
        task = asyncio.ensure_future(sched.submit([Item("a")], "k", timing, None))
        await until(backend.entered.is_set)
        await asyncio.sleep(0.15)
        backend.gate.set()
        await task
        await sched.stop()
        return timing.stages

    stages = run(main())
    assert stages["queue"] < 0.1 and 0.12 < stages["infer"] < 2

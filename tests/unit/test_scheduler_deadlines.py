"""Deadlines, departures and drops: a request past its deadline before it starts gets 504
and never runs, expired or abandoned jobs never lead a batch, a running call is told to
stop (cancellable) or waited for (not), a client that leaves is out of the queue at once,
shutdown takes queued work with it, and every drop is counted by reason."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.runtime.errors import ApiError, ClientGone
from services.runtime.pipeline.queued import QueuedItem, QueuedRequest
from services.runtime.pipeline.timing import Timing
from tests.fakes.model_backend import (
    Client,
    Item,
    dropped,
    hold,
    run,
    scheduler,
    stale_job,
    until,
)


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
        # the stale job carries its own deadline; the blocker's is long (at 50 ms a busy machine
        # let it expire before the batch loop took it, and it never reached the model)
        sched, backend = scheduler(request_timeout_s=5.0)
        blocker = await hold(sched, backend)
        timing = Timing()
        timing.t0 -= 10  # arrived long ago: expired at once
        loop = asyncio.get_running_loop()
        # enqueue without a waiter (as if its timer had not fired yet)
        job = QueuedRequest([Item("stale")], "hold", timing.t0 + 0.05, timing.t0, loop.create_future())
        job.results, job.remaining = [None], 1
        sched._pending.append(QueuedItem(job, 0))
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


def test_an_expired_item_behind_the_head_does_not_join_the_batch():
    async def main():
        sched, backend = scheduler(request_timeout_s=30)
        blocker = await hold(sched, backend)
        fresh = asyncio.ensure_future(sched.submit([Item("fresh")], "k", Timing(), None))
        await until(lambda: sched.pending_items == 1)
        loop = asyncio.get_running_loop()
        old = Timing()
        old.t0 -= 100
        stale = QueuedRequest([Item("stale")], "k", old.t0 + 1, old.t0, loop.create_future())
        stale.results, stale.remaining = [None], 1
        sched._pending.append(QueuedItem(stale, 0))  # compatible, behind the head, long expired
        backend.gate.set()
        await asyncio.gather(blocker, fresh)
        await asyncio.sleep(0.05)
        await sched.stop()
        return backend.batches

    batches = run(main())
    assert batches[1] == ["fresh"] and all("stale" not in b for b in batches)


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
            sched._pending.append(QueuedItem(job, 0))
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

"""Admission and a request's stages: a request counts the moment it arrives and is refused
(503) beyond max_queue, max_queue 0 admits only to an idle model, a ticket moves from
waiting to running when the model takes the request, and Server-Timing's queue and infer
figures are the queue wait and the model time."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.errors import ApiError
from services.runtime.pipeline.admission import Admission
from services.runtime.pipeline.timing import Timing
from tests.fakes.model_backend import Item, hold, run, scheduler, until


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

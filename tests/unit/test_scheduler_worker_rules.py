"""The scheduler's model side, from surviving mutants (docs/mutation-testing.md): one named
GPU thread, busy time and health problems, stopping without waiting for a stuck call, out
of memory as a 503 with its log lines, and the retry item by item."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from services.runtime.pipeline.timing import Timing
from services.runtime.errors import ApiError, ClientGone
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.scheduler import GpuWorker, Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from tests.unit.test_scheduler import Client, Item, Recorder, hold, run, scheduler, until
from tests.unit.test_scheduler_rules import dropped


# ---- the GPU worker ------------------------------------------------------------------------
def test_every_model_call_runs_on_one_named_thread_one_at_a_time():
    async def main():
        worker = GpuWorker()
        seen, active, peak = [], [0], [0]

        def call(tag):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            seen.append((tag, threading.current_thread().name))
            time.sleep(0.02)
            active[0] -= 1
            return tag

        out = await asyncio.gather(*(worker.run(call, i) for i in range(3)),
                                   worker.run(call, "load", tracked=False))
        worker.shutdown()
        return out, seen, peak[0]

    out, seen, peak = run(main())
    assert out == [0, 1, 2, "load"] and peak == 1
    names = {name for _, name in seen}
    assert len(names) == 1 and names.pop().startswith("onecard-gpu")


def test_busy_for_counts_a_tracked_call_only_while_it_runs():
    async def main():
        worker = GpuWorker()
        gate, entered = threading.Event(), threading.Event()

        def call():
            entered.set()
            gate.wait(5)

        try:
            assert worker.busy_for() == 0.0
            task = asyncio.ensure_future(worker.run(call))
            await until(entered.is_set)
            await asyncio.sleep(0.05)
            during = worker.busy_for()
            gate.set()
            await task
            after = worker.busy_for()
            entered.clear()
            gate.clear()
            task = asyncio.ensure_future(worker.run(call, tracked=False))  # loading: never "stuck"
            await until(entered.is_set)
            await asyncio.sleep(0.05)
            untracked = worker.busy_for()
            gate.set()
            await task
        finally:
            gate.set()
            worker.shutdown()
        return during, after, untracked

    during, after, untracked = run(main())
    assert 0.04 < during < 2 and after == 0.0 and untracked == 0.0


def test_stop_neither_waits_for_a_stuck_call_nor_runs_queued_ones():
    async def main():
        worker = GpuWorker()
        gate, entered, ran = threading.Event(), threading.Event(), []

        def stuck():
            entered.set()
            gate.wait(5)

        try:
            first = asyncio.ensure_future(worker.run(stuck))
            queued = asyncio.ensure_future(worker.run(ran.append, "queued"))
            await until(entered.is_set)
            t0 = time.perf_counter()
            worker.shutdown()
            took = time.perf_counter() - t0
        finally:
            gate.set()
        await first
        await asyncio.gather(queued, return_exceptions=True)
        return took, ran, queued

    took, ran, queued = run(main())
    assert took < 1 and ran == [] and queued.cancelled()


def test_problem_reports_a_stuck_call_and_a_stopped_loop():
    async def main():
        sched, backend = scheduler(inference_timeout_s=0.05)
        assert sched.problem() is None
        # a task dump (asyncio.all_tasks, a debugger) names the loop, as the thread dump names the GPU thread
        assert "onecard-batch-loop" in {t.get_name() for t in asyncio.all_tasks()}
        blocker = await hold(sched, backend)
        await asyncio.sleep(0.1)
        stuck = sched.problem()
        backend.gate.set()
        await blocker
        healthy = sched.problem()
        await sched.stop()
        return stuck, healthy, sched.problem()

    stuck, healthy, stopped = run(main())
    assert stuck is not None and stuck.startswith("a model call has been running for ") and stuck.endswith(" s")
    assert healthy is None and stopped == "the batch loop has stopped"


def test_a_scheduler_never_started_stops_cleanly_and_reports_no_problem():
    async def main():
        sched = Scheduler(Recorder(), ModelServiceSettings(), PipelineMetrics())
        assert sched.problem() is None and sched.in_flight == 0  # /status: nothing on the model yet
        await sched.stop()
    run(main())


# ---- out of memory and the retry item by item ----------------------------------------------------
def test_out_of_memory_is_a_503_with_retry_after_logged_and_counted(caplog):
    async def main():
        sched, backend = scheduler(retry_after_s=7)

        def oom(items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

        def failing_free():
            raise RuntimeError("cache flush failed")
        backend.infer_batch = oom
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("big")], "k", Timing(), None)
        backend.on_out_of_memory = failing_free
        with pytest.raises(ApiError) as again:  # freeing memory failed: still a 503, not a crash
            await sched.submit([Item("big")], "k", Timing(), None)
        out_of_memory = dropped(sched, "out_of_memory")
        await sched.stop()
        return err.value, again.value, out_of_memory

    with caplog.at_level(logging.WARNING, logger="onecard.service"):
        err, again, count = run(main())
    assert (err.status, err.code) == (503, "out_of_memory")
    assert err.message == "the model ran out of GPU memory; retry later"
    assert err.headers == {"Retry-After": "7"}
    assert (again.status, again.code) == (503, "out_of_memory") and count == 2
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("GPU out of memory: CUDA out of memory. Tried to allocate 2 GiB") == 2
    failed = [r for r in caplog.records if r.getMessage() == "freeing memory after out-of-memory failed"]
    assert len(failed) == 1 and failed[0].exc_info and "cache flush failed" in str(failed[0].exc_info[1])


def test_an_api_error_from_the_backend_passes_through_unchanged():
    async def main():
        sched, backend = scheduler()

        def refuse(items):
            raise ApiError(507, "no_room", "out of memory on disk")
        backend.infer_batch = refuse
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("x")], "k", Timing(), None)
        await sched.stop()
        return err.value, backend.freed, dropped(sched, "out_of_memory")

    err, freed, count = run(main())
    assert (err.status, err.code, err.message) == (507, "no_room", "out of memory on disk")
    assert freed == 0 and count == 0


def test_an_item_whose_client_left_is_not_retried_alone():
    """A batch fails and is retried item by item; an item whose client left meanwhile is
    skipped, not run alone."""
    async def main():
        sched, backend = scheduler()
        calls, gate, on_model, pair_gate = [], threading.Event(), threading.Event(), threading.Event()

        def infer(items):
            calls.append([i.name for i in items])
            on_model.set()
            gate.wait(5)
            if len(items) > 1:
                pair_gate.wait(5)
                raise RuntimeError("a bad batch")
            return [f"out:{i.name}" for i in items]
        backend.infer_batch = infer
        blocker = asyncio.ensure_future(sched.submit([Item("blocker")], "hold", Timing(), None))
        await until(on_model.is_set)
        client = Client()
        gone = asyncio.ensure_future(
            sched.submit([Item("x1", cancel=threading.Event())], "k", Timing(), client.receive))
        stays = asyncio.ensure_future(sched.submit([Item("x2")], "k", Timing(), None))
        await until(lambda: sched.pending_items == 2)
        gate.set()
        await blocker
        await until(lambda: len(calls) == 2)  # [x1, x2] is on the model
        client.gone.set()
        with pytest.raises(ClientGone):
            await gone
        pair_gate.set()
        results = await asyncio.gather(gone, stays, return_exceptions=True)
        await sched.stop()
        return calls, results

    calls, results = run(main())
    assert calls[:2] == [["blocker"], ["x1", "x2"]]
    assert calls[2:] == [["x2"]], "x1's client had left: only x2 is retried"
    assert results[1] == ["out:x2"]


def test_a_backend_returning_the_wrong_number_of_results_fails_the_request_with_the_reason():
    async def main():
        sched, backend = scheduler()
        backend.infer_batch = lambda items: []
        with pytest.raises(RuntimeError) as err:
            await sched.submit([Item("x")], None, Timing(), None)
        await sched.stop()
        return str(err.value)

    assert run(main()) == "backend returned 0 results for 1 items"


def test_an_out_of_memory_batch_logs_the_error_and_frees_memory_once_before_the_retries(caplog):
    async def main():
        sched, backend = scheduler()
        backend.raise_on_batch = "o1"
        blocker = await hold(sched, backend)
        tasks = [asyncio.ensure_future(sched.submit([Item(n)], None, Timing(), None)) for n in ("o1", "o2")]
        await until(lambda: sched.pending_items == 2)
        backend.gate.set()
        await asyncio.gather(blocker, *tasks)
        await sched.stop()
        return backend.freed

    with caplog.at_level(logging.WARNING, logger="onecard.service"):
        freed = run(main())
    assert freed == 1
    assert [r.getMessage() for r in caplog.records] == ["GPU out of memory: CUDA out of memory. Tried to allocate 1 GiB"]


def test_decode_encode_and_model_threads_yield_the_cpu_to_the_event_loop():
    """On a small machine busy decoding, the loop that answers /healthz must get a core when it
    needs one: the CPU pool's threads and the model's thread run at a lower priority (a higher
    nice value) than the thread that runs the event loop."""
    import os
    import threading

    from services.runtime.pipeline.cpu_pool import CpuPool

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main():
        pool, worker = CpuPool(2), GpuWorker()
        try:
            return nice(), await pool.run(nice), await worker.run(nice)
        finally:
            pool.shutdown()
            worker.shutdown()

    loop_nice, cpu_nice, model_nice = asyncio.run(main())
    assert cpu_nice > loop_nice and model_nice > loop_nice

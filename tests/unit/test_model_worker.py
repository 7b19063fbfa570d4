"""The model's thread and what /healthz learns from it: every call on one named thread, one
at a time; how long the current call has run; stop neither waits for a stuck call nor runs
queued ones; a stuck call or a stopped batch loop is a problem; the CPU pool and the
model's thread yield the CPU to the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.scheduler import GpuWorker, Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from tests.fakes.model_backend import Recorder, hold, run, scheduler, until


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

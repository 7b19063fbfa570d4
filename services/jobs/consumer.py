"""One consumer per local service: takes that model's jobs when the service has room and
runs each through the service's public HTTP API (so its FIFO, batching, limits and
metrics apply), then writes the outcome back. What an outcome means for the job is
policy.py's to decide.

Backpressure is pull-based: ``max_in_flight`` slots; the consumer waits for a free slot
before it reads the queue at all, and a 503 from the service holds the job (not an
attempt) until Retry-After. A cancel closes the HTTP request, which makes the service
drop the job or stop the generation between steps, as a client disconnect does.

Crashes: a request that never reached the service (connection refused) is sent again once
the service is back, at no cost. When the service goes away with requests in flight, each
of those jobs is run again alone, one after the other (gate.py); only a job that crashes
the service while running alone is charged an attempt. A run whose lease was taken over
by another unit (this one stalled) stops without writing anything.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from services.jobs.broker import Broker, QueueUnavailable
from services.jobs.gate import CallGate
from services.jobs.metrics import JobsMetrics
from services.jobs.policy import Verdict, classify, retry_after_s
from services.jobs.records import CANCELLED, FAILED, KEPT_HEADERS, SUCCEEDED, Delivery, Outcome, error_doc
from services.jobs.settings import JobsSettings
from services.jobs.targets import Answer, ResultTooLarge, Target, TargetCrashed, TargetNotSent, TargetTimeout
from services.jobs.tracing import AttemptTrace

log = logging.getLogger("onecard.jobs")
CANCEL, SHUTDOWN, LOST = "cancel", "shutdown", "lost"


class Room:
    """Free slots on the local service."""

    def __init__(self, size: int):
        self.size = self.free = size
        self._changed = asyncio.Event()

    async def wait_free(self) -> None:
        while self.free == 0:
            self._changed.clear()
            await self._changed.wait()

    def take_all(self) -> int:
        n, self.free = self.free, 0
        return n

    def give(self, n: int = 1) -> None:
        self.free += n
        self._changed.set()


@dataclass
class Running:
    delivery: Delivery
    waiting_on: asyncio.Task | None = None   # what a stop interrupts: the HTTP call or a wait
    stop_reason: str | None = None
    trace: AttemptTrace | None = None        # with traces on: the attempt's span


def is_json_document(data: bytes) -> bool:
    """Checked once, when the job finishes: a poll then copies it into the job's view as it is."""
    try:
        json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return True


class Consumer:
    def __init__(self, broker: Broker, target: Target, settings: JobsSettings, metrics: JobsMetrics,
                 renew_period_s: float, is_json=None, traces=None):
        self.broker, self.target, self.settings, self.metrics = broker, target, settings, metrics
        self.traces = traces  # services.runtime.traces.tracer.Traces, None when traces are off
        self.label = target.label
        self.room = Room(target.max_in_flight)
        self.gate = CallGate()
        self.running: dict[str, Running] = {}
        self.renew_period_s = renew_period_s
        self.is_json = is_json  # JobsService.is_json: big results are checked away from the loop and its GIL
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._renew_task: asyncio.Task | None = None
        self._has_running = asyncio.Event()
        self._stopping = False
        self._hold_until = 0.0
        self.loop_errors = 0

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._take_loop(), name=f"jobs-consumer-{self.label}")
        self._renew_task = loop.create_task(self._renew_loop(), name=f"jobs-renew-{self.label}")

    def problem(self) -> str | None:
        for task in (self._loop_task, self._renew_task):
            if task is not None and task.done() and not self._stopping:
                return f"the consumer of {self.label} has stopped"
        return None

    def stop_taking(self) -> None:
        """Take no new job (the unit is draining); running ones carry on."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()

    async def stop(self, drain_s: float) -> None:
        """Stop taking jobs; give running ones ``drain_s``, then hand the rest back to the queue."""
        self.stop_taking()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._tasks and drain_s > 0:
            await asyncio.wait(set(self._tasks), timeout=drain_s)
        for run in list(self.running.values()):
            self._interrupt(run, SHUTDOWN)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        for task in list(self._tasks):
            task.cancel()
        if self._renew_task is not None:
            self._renew_task.cancel()
            await asyncio.gather(self._renew_task, return_exceptions=True)

    def cancel(self, job_id: str) -> bool:
        run = self.running.get(job_id)
        if run is None:
            return False
        self._interrupt(run, CANCEL)
        return True

    def _interrupt(self, run: Running, reason: str) -> None:
        if run.stop_reason is None:
            run.stop_reason = reason
        if run.waiting_on is not None:
            run.waiting_on.cancel()

    # ---- taking jobs ------------------------------------------------------------------
    async def _take_loop(self) -> None:
        backoff = 0.1
        while True:
            await self.room.wait_free()
            await self.gate.wait_clear()  # jobs suspected of a crash run alone first
            if not self.target.up:
                await self.target.wait_up()
            hold = self._hold_until - time.monotonic()
            if hold > 0:  # the service said Retry-After: take nothing new before then
                await asyncio.sleep(hold)
                continue
            n = self.room.take_all()
            deliveries = await self._take(n, backoff)
            if deliveries is None:
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            backoff = 0.1
            self.room.give(n - len(deliveries))
            self._spawn_all(deliveries)
            # Bound here, the last batch (bodies of tens of MB each) would outlive its jobs for
            # as long as the loop waits for new work: for good on an idle unit.
            del deliveries

    async def _take(self, n: int, backoff: float) -> list[Delivery] | None:
        """Up to ``n`` jobs, or None when the take failed (logged; the slots given back). The
        caller sleeps its backoff once out of here: a failure still held while it sleeps keeps
        the frames of its context alive, with what a failed take had read (job bodies)."""
        try:
            return await self.broker.take(self.label, n, block_s=5.0)
        except asyncio.CancelledError:
            self.room.give(n)
            raise
        except Exception as exc:  # noqa: BLE001 - the loop outlives any one failure
            self.room.give(n)
            self.loop_errors += 1
            if isinstance(exc, QueueUnavailable):
                log.warning("jobs: queue unavailable for %s (%s); retrying in %.1f s", self.label, exc, backoff)
            else:
                log.exception("jobs: taking %s jobs failed", self.label)
            return None

    def _spawn_all(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            self._spawn(d)

    def _spawn(self, d: Delivery) -> None:
        self.running[d.job_id] = Running(d)
        self._has_running.set()
        self.metrics.in_progress.labels(self.label).inc()
        if d.queued_at is not None and d.started_at is not None:
            self.metrics.observe("queued", d.started_at - d.queued_at)
        task = asyncio.get_running_loop().create_task(self._run(d), name=f"job-{d.job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _renew_loop(self) -> None:
        """Renew the lease of running jobs (visibility), pick up cancels missed on pub/sub,
        and stop runs whose job another unit took over."""
        while True:
            await self._has_running.wait()
            await asyncio.sleep(self.renew_period_s)
            await self._renew_running()

    async def _renew_running(self) -> None:
        # A method of its own: the runs it looks at hold their jobs' bodies, which must not stay
        # bound in the loop's frame while it sleeps (a renew period after the jobs have ended).
        runs = list(self.running.values())
        if not runs:
            self._has_running.clear()
            return
        try:
            verdicts = await self.broker.renew(self.label, [r.delivery for r in runs])
        except QueueUnavailable as exc:
            log.warning("jobs: cannot renew running jobs of %s: %s", self.label, exc)
            return
        except Exception:  # noqa: BLE001
            log.exception("jobs: renewing %s failed", self.label)
            return
        for run in runs:
            verdict = verdicts.get(run.delivery.job_id)
            if verdict == "cancel":
                self._interrupt(run, CANCEL)
            elif verdict == "lost":
                log.warning("jobs: %s was taken over by another unit (this one stalled past the visibility "
                            "timeout); this run stops and writes nothing", run.delivery.job_id)
                self._interrupt(run, LOST)

    # ---- running one job -----------------------------------------------------------
    async def _run(self, d: Delivery) -> None:
        t0 = time.monotonic()
        trace = None
        if self.traces is not None:
            trace = self.running[d.job_id].trace = AttemptTrace(self.traces, d, self.broker.node)
        failure: BaseException | None = None
        try:
            await self._attempt(d)
        except asyncio.CancelledError as exc:
            failure = exc
            raise
        except Exception as exc:  # noqa: BLE001 - one job never takes the consumer down
            failure = exc
            log.exception("jobs: job %s broke its run", d.job_id)
            await self._finish(d, Outcome(FAILED, error=error_doc(
                "internal_error", f"the job could not be run: {type(exc).__name__}"), dead_letter=True))
        finally:
            if trace is not None:
                trace.end(failure)
            self.metrics.observe("running", time.monotonic() - t0)
            self.running.pop(d.job_id, None)
            self.broker.run_ended(d)
            self.metrics.in_progress.labels(self.label).dec()
            self.room.give(1)

    async def _interruptible(self, run: Running, coro) -> Any:
        """Await ``coro`` so that a cancel, a shutdown or a lost lease can interrupt it; None
        when interrupted."""
        task = asyncio.get_running_loop().create_task(coro)
        run.waiting_on = task
        if run.stop_reason is not None:
            task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if run.stop_reason is None or not task.cancelled() or asyncio.current_task().cancelling():
                raise
            return None
        finally:
            run.waiting_on = None
            # A failure leaving here carries this frame in its traceback: kept bound, the task
            # (which holds the failure) would close a cycle that pins the call's frames, the
            # job's body among them, until a full collection.
            del task

    async def _attempt(self, d: Delivery) -> None:
        run = self.running[d.job_id]
        if d.route not in self.target.routes:  # a queue entry is not trusted: only known job routes run
            await self._finish(d, Outcome(FAILED, error=error_doc(
                "unknown_route", f"{d.route[:300]!r} is not a job route of {self.target.name} on this unit", 404)))
            return
        held_until = time.monotonic() + self.settings.backpressure_requeue_s
        while True:
            if not self.target.up:
                try:  # not for ever: another unit's service may be up
                    await self._interruptible(run, asyncio.wait_for(self.target.wait_up(),
                                                                    self.settings.backpressure_requeue_s))
                except TimeoutError:
                    return await self._requeue(d, error_doc("service_unreachable", f"{self.target.name} has not "
                                                            "been up for backpressure_requeue_s"), charged=False)
                if run.stop_reason is not None:
                    return await self._stopped(d, run)
            ticket = await self._interruptible(run, self.gate.enter(solo=d.isolate))
            if ticket is None:
                return await self._stopped(d, run)
            if not self.target.up:  # it crashed while this run waited its turn
                await self.gate.leave(ticket)
                continue
            try:
                if d.isolate:  # losing the unit now is charged to this job alone
                    await self._write(self.broker.mark_solo, d)
                resp = await self._interruptible(run, self.target.call(
                    d.route, d.body, d.job_id, None if run.trace is None else run.trace.headers()))
            except TargetTimeout:
                return await self._requeue(d, error_doc("timeout", f"no answer from {self.target.name} within "
                                                        f"{self.settings.run_timeout_s:g} s"), charged=True)
            except ResultTooLarge as exc:  # the same job would answer as much again: not retried
                return await self._finish(d, Outcome(FAILED, error=error_doc("result_too_large", str(exc))))
            except TargetNotSent:
                await self.target.reset()  # wait until it is back, then send it again: not an attempt
                if self._stopping:
                    return await self._requeue(d, None, charged=False)
                continue
            except TargetCrashed as exc:
                await self.target.reset()
                self.metrics.count("crashed")
                d.isolate = True  # whatever comes next, it runs alone until it finishes
                if ticket.alone:
                    # charged even when the unit is stopping: on a real unit the crash is what stops it,
                    # and a crasher never charged would crash it again on every restart
                    log.warning("jobs: %s crashed %s running alone; charged an attempt", d.job_id, self.target.name)
                    return await self._requeue(d, error_doc("service_crashed", f"{self.target.name} went away while "
                                                            f"it ran this job alone: {exc}"), charged=True)
                self.metrics.count("isolated")
                if self._stopping:  # cannot run it again here: back to the queue, to run alone elsewhere
                    return await self._requeue(d, error_doc("service_unreachable", str(exc)), charged=False)
                log.warning("jobs: %s was in flight when %s went away; it runs again alone", d.job_id,
                            self.target.name)
                continue
            finally:
                await self.gate.leave(ticket)
            if resp is None or run.stop_reason == LOST:  # a run whose job was taken over writes nothing
                return await self._stopped(d, run)
            if not await self._answered(d, resp):
                return
            wait = retry_after_s(resp.headers.get("retry-after"), float(self.settings.retry_after_s or 1))
            if time.monotonic() + wait > held_until:  # the service keeps refusing: let another unit have it
                return await self._requeue(d, None, charged=False)
            if await self._interruptible(run, asyncio.sleep(wait, True)) is None:
                return await self._stopped(d, run)

    async def _answered(self, d: Delivery, resp: Answer) -> bool:
        """Write what the service's answer means; True when the job is held (backpressure)."""
        verdict = classify(resp.status, resp.error()["code"] if resp.status >= 400 else None)
        if verdict is Verdict.SUCCEEDED:
            headers = {k: resp.headers[k] for k in KEPT_HEADERS if k in resp.headers}
            ctype = resp.headers.get("content-type", "application/octet-stream")
            is_json = ctype.split(";")[0].strip() in ("application/json", "text/json") and \
                (is_json_document(resp.body) if self.is_json is None else await self.is_json(resp.body))
            await self._finish(d, Outcome(SUCCEEDED, resp.body, ctype, resp.status, headers, result_json=is_json))
            return False
        if verdict is Verdict.REJECTED:
            await self._finish(d, Outcome(FAILED, resp.body, resp.headers.get("content-type", ""), resp.status,
                                          error=resp.error()))
            return False
        if verdict is Verdict.ATTEMPT_FAILED:
            await self._requeue(d, resp.error(), charged=True)
            return False
        # backpressure: the service is full; hold the job, take nothing new, try again
        self.metrics.backpressure.inc()
        wait = retry_after_s(resp.headers.get("retry-after"), float(self.settings.retry_after_s or 1))
        self._hold_until = max(self._hold_until, time.monotonic() + wait)
        return True

    async def _stopped(self, d: Delivery, run: Running) -> None:
        if run.stop_reason == LOST:
            self.metrics.count("fenced")  # another unit holds the job now: nothing to write
            self._traced(d, "fenced")
        elif run.stop_reason == SHUTDOWN:
            await self._requeue(d, None, charged=False)
        else:
            await self._finish(d, Outcome(CANCELLED, error=error_doc("cancelled", "cancelled while it ran")))

    async def _finish(self, d: Delivery, outcome: Outcome) -> None:
        verdict = await self._write(self.broker.finish, d, outcome)
        if verdict == "ok":
            self.metrics.count(outcome.state)
            if outcome.dead_letter:
                self.metrics.count("dead_lettered")
            self._traced(d, "dead_lettered" if outcome.dead_letter else outcome.state, outcome.error)
        elif verdict == "no_room":
            self.metrics.count("failed")
            self._traced(d, "failed", {"code": "result_too_large"})
            log.error("jobs: %s: its result is over the room reserved for it and the queue is full; the job "
                      "failed (result_too_large)", d.job_id)
        elif verdict in ("lost", "duplicate"):  # another run holds the job, or wrote its outcome already
            self.metrics.count("fenced")
            log.warning("jobs: %s: another run took the job over; this run's outcome is dropped", d.job_id)
        else:
            self.metrics.count("duplicate")

    async def _requeue(self, d: Delivery, error: dict[str, Any] | None, charged: bool) -> None:
        verdict = await self._write(self.broker.requeue, d, error, charged, d.isolate)  # isolation sticks
        counted = {"requeued": "retried" if charged else "released", "dead": "dead_lettered",
                   "cancelled": "cancelled", "lost": "fenced", "done": "fenced"}.get(verdict, "duplicate")
        self.metrics.count(counted)
        self._traced(d, counted, error)
        if verdict == "dead":
            self.metrics.count("failed")
            log.warning("jobs: %s failed after its last attempt: %s", d.job_id, error)

    def _traced(self, d: Delivery, outcome: str, error: dict[str, Any] | None = None) -> None:
        run = self.running.get(d.job_id)
        if run is not None and run.trace is not None:
            run.trace.ended(outcome, error)

    async def _write(self, op, *args) -> Any:
        """A state write that must not be lost to a short queue outage: retried with backoff
        (the job's lease expires meanwhile only if the outage outlasts the visibility timeout)."""
        delay = 0.1
        while True:
            try:
                return await op(*args)
            except QueueUnavailable as exc:
                log.warning("jobs: queue unavailable while writing %s (%s); retrying", args[0].job_id, exc)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

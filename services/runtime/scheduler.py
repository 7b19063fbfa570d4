"""From decoded requests to model results: one FIFO queue, batches, deadlines, cancellation.

A request brings one or more items (a webui call with ``batch_size = 4`` brings four)
and a compatibility key: only items with equal keys may share a model call. The batch
loop always starts a batch with the OLDEST waiting item and adds the compatible items
behind it in arrival order, up to ``max_batch_size``: nothing overtakes the head of the
queue, so nothing starves. Every model call runs on the one GPU worker thread, under
the service's FifoLock.

A request whose client leaves, or whose deadline passes, is dropped before it costs
model time. Once running, an item that can stop between steps (it has a ``cancel``
event) is told to; its batch carries on for the others, and the backend stops the call
when every item in it is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from services.runtime.admission import Ticket
from services.runtime.backend import Backend, is_out_of_memory
from services.runtime.codec import Timing
from services.runtime.errors import ApiError, ClientGone
from services.runtime.fifo import FifoLock
from services.runtime.metrics import ServiceMetrics
from services.runtime.settings import RuntimeSettings

log = logging.getLogger("onecard.service")


class GpuWorker:
    """One thread for every model call; knows how long the current call has been running."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onecard-gpu")
        self._busy_since: float | None = None

    async def run(self, fn: Callable, *args: Any, tracked: bool = True) -> Any:
        """Run on the worker thread; `tracked` calls count towards a stuck worker (not loading)."""
        loop = asyncio.get_running_loop()
        if tracked:
            return await loop.run_in_executor(self._pool, self._call, fn, args)
        return await loop.run_in_executor(self._pool, fn, *args)

    def _call(self, fn: Callable, args: tuple) -> Any:
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._busy_since = None

    def busy_for(self) -> float:
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def wait_disconnect(receive: Callable) -> None:
    """Returns when the client has gone. Only call once the body has been read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@dataclass(eq=False)
class Job:
    """One request's items on their way through the queue (compared by identity)."""
    items: list[Any]
    key: Hashable
    deadline: float
    enqueued: float
    future: asyncio.Future
    ticket: Ticket | None = None
    results: list[Any] = field(default_factory=list)
    remaining: int = 0
    started_at: float | None = None
    infer_s: float = 0.0
    abandoned: bool = False          # nobody waits for the result any more

    def cancel_items(self) -> None:
        self.abandoned = True
        for item in self.items:
            event = getattr(item, "cancel", None)
            if isinstance(event, threading.Event):
                event.set()

    @property
    def cancellable(self) -> bool:
        return all(isinstance(getattr(i, "cancel", None), threading.Event) for i in self.items)


@dataclass(eq=False)
class _Entry:
    job: Job
    index: int


class Scheduler:
    def __init__(self, backend: Backend, settings: RuntimeSettings, metrics: ServiceMetrics,
                 worker: GpuWorker | None = None):
        self.backend, self.settings, self.metrics = backend, settings, metrics
        self.worker = worker or GpuWorker()
        self.lock = FifoLock()
        self.max_batch = settings.max_batch_size if backend.supports_batching else 1
        self.batching = self.max_batch > 1
        self._pending: collections.deque[_Entry] = collections.deque()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.in_flight = 0

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop(), name="onecard-batch-loop")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self.worker.shutdown()

    def problem(self) -> str | None:
        """Why the model side cannot serve (for /healthz), or None. Thread-safe reads only."""
        task = self._loop_task
        if task is not None and task.done():
            return "the batch loop has stopped"
        busy = self.worker.busy_for()
        if busy > self.settings.inference_timeout_s:
            return f"a model call has been running for {busy:.1f} s"
        return None

    @property
    def pending_items(self) -> int:
        return len(self._pending)

    # ---- the one entry point ----------------------------------------------------------
    async def submit(self, items: list[Any], key: Hashable, timing: Timing, receive: Callable | None,
                     ticket: Ticket | None = None) -> list[Any]:
        """Results for `items`, in order. Raises ApiError (504, 503) or ClientGone."""
        loop = asyncio.get_running_loop()
        job = Job(items, key, timing.t0 + self.settings.request_timeout_s, time.perf_counter(),
                  loop.create_future(), ticket, [None] * len(items), len(items))
        for i in range(len(items)):
            self._pending.append(_Entry(job, i))
        self._wake.set()
        gone = asyncio.ensure_future(wait_disconnect(receive)) if receive is not None else None
        try:
            return await self._await_job(job, gone, timing)
        except asyncio.CancelledError:  # the drain ran out of time: stop its work too
            self._abandon(job, "shutdown")
            raise
        finally:
            if gone is not None:
                gone.cancel()

    async def _await_job(self, job: Job, gone: asyncio.Future | None, timing: Timing) -> list[Any]:
        waiters = {job.future} if gone is None else {job.future, gone}
        while True:
            left = job.deadline - time.perf_counter()
            done, _ = await asyncio.wait(waiters, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
            if job.future in done:
                self._stage_times(job, timing)
                return job.future.result()
            if gone is not None and gone in done:
                self._abandon(job, "client_gone")
                raise ClientGone()
            # the deadline passed
            if job.started_at is None:
                self._abandon(job, "deadline")
                raise ApiError(504, "deadline_exceeded",
                               f"not started within the request deadline of {self.settings.request_timeout_s:g} s")
            if job.cancellable:
                self._abandon(job, "deadline")
                raise ApiError(504, "deadline_exceeded",
                               f"stopped at the request deadline of {self.settings.request_timeout_s:g} s")
            # a call that cannot stop midway is short: wait for it, still watching the client
            waiters = {job.future} if gone is None else {job.future, gone}
            job.deadline = float("inf")

    def _abandon(self, job: Job, reason: str) -> None:
        """Nobody waits for this job any more: out of the queue now, told to stop if running."""
        if job.abandoned:
            return
        job.cancel_items()
        self.metrics.dropped.labels(reason).inc()
        if job.started_at is None:
            self._pending = collections.deque(e for e in self._pending if e.job is not job)
        job.future.cancel()  # a no-op when it already has its result or error

    def _stage_times(self, job: Job, timing: Timing) -> None:
        if job.started_at is not None:
            timing.add("queue", job.started_at - job.enqueued)
            timing.add("infer", job.infer_s)

    # ---- the batch loop ---------------------------------------------------------------
    def _take_batch(self) -> list[_Entry]:
        """The oldest live entry and the compatible ones behind it, in arrival order."""
        now = time.perf_counter()
        while self._pending:
            head = self._pending[0]
            if head.job.abandoned:
                self._pending.popleft()
                continue
            if head.job.started_at is None and now > head.job.deadline:
                self._pending.popleft()
                self._expire(head.job)
                continue
            break
        if not self._pending:
            return []
        key = self._pending[0].job.key
        batch: list[_Entry] = []
        rest: collections.deque[_Entry] = collections.deque()
        for entry in self._pending:
            job = entry.job
            if (len(batch) < self.max_batch and not job.abandoned and job.key == key
                    and (job.started_at is not None or now <= job.deadline)):
                batch.append(entry)
            elif not job.abandoned:
                rest.append(entry)
        self._pending = rest
        return batch

    def _expire(self, job: Job) -> None:
        if not job.future.done():
            job.future.set_exception(ApiError(
                504, "deadline_exceeded",
                f"not started within the request deadline of {self.settings.request_timeout_s:g} s"))
        self._abandon(job, "deadline")

    async def _batch_loop(self) -> None:
        s = self.settings
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            if s.max_wait_ms > 0 and self.batching:
                fill_until = self._pending[0].job.enqueued + s.max_wait_ms / 1000
                while len(self._pending) < self.max_batch:
                    left = fill_until - time.perf_counter()
                    if left <= 0:
                        break
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), left)
                    except asyncio.TimeoutError:
                        break
            batch = self._take_batch()
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[_Entry]) -> None:
        await self.lock.acquire()
        t0 = time.perf_counter()
        try:
            for entry in batch:
                job = entry.job
                if job.started_at is None:
                    job.started_at = t0
                    if job.ticket is not None:
                        job.ticket.started()
            results = await self._infer([e.job.items[e.index] for e in batch])
        finally:
            self.lock.release()
        dt = time.perf_counter() - t0
        for entry, result in zip(batch, results):
            job = entry.job
            job.results[entry.index] = result
            job.infer_s += dt
            job.remaining -= 1
            if job.remaining == 0 and not job.future.done():
                failure = next((r for r in job.results if isinstance(r, BaseException)), None)
                if failure is not None:
                    job.future.set_exception(failure)
                else:
                    job.future.set_result(job.results)

    async def _infer(self, payloads: list[Any]) -> list[Any]:
        """One model call; a failing batch is retried item by item so a bad item fails alone."""
        # One batch is on the model at a time (the batch loop awaits each), so this is a set.
        self.in_flight = len(payloads)
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.batch_size.observe(len(payloads))
        try:
            try:
                results = await self.worker.run(self.backend.infer_batch, payloads)
                if len(results) != len(payloads):
                    raise RuntimeError(f"backend returned {len(results)} results for {len(payloads)} items")
            except Exception as exc:  # noqa: BLE001
                if len(payloads) == 1:
                    results = [exc]
                else:
                    if is_out_of_memory(exc):
                        self._free_memory(exc)
                    results = [await self._infer_alone(p) for p in payloads]
            return [self._out_of_memory(r) if isinstance(r, BaseException) and is_out_of_memory(r) else r
                    for r in results]
        finally:
            self.in_flight = 0
            self.metrics.in_flight.set(0)

    async def _infer_alone(self, payload: Any) -> Any:
        event = getattr(payload, "cancel", None)
        if isinstance(event, threading.Event) and event.is_set():
            return ClientGone()
        try:
            return (await self.worker.run(self.backend.infer_batch, [payload]))[0]
        except Exception as exc:  # noqa: BLE001 - this item's own failure
            return exc

    def _free_memory(self, exc: BaseException) -> None:
        log.warning("GPU out of memory: %s", exc)
        try:
            self.backend.on_out_of_memory()
        except Exception:  # noqa: BLE001 - freeing memory must not turn one 503 into a crash
            log.exception("freeing memory after out-of-memory failed")

    def _out_of_memory(self, exc: BaseException) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        self._free_memory(exc)
        self.metrics.dropped.labels("out_of_memory").inc()
        return ApiError(503, "out_of_memory", "the model ran out of GPU memory; retry later",
                        {"Retry-After": str(self.settings.retry_after_s)})

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
import logging
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from typing import Any

from common import hostmemory as memory
from services.runtime.errors import ApiError, ClientGone
from services.runtime.pipeline.admission import Ticket
from services.runtime.pipeline.backend import Backend, is_out_of_memory
from services.runtime.pipeline.batch_policy import BatchPolicy, Decision
from services.runtime.pipeline.cost import ServiceCost
from services.runtime.pipeline.fifo_lock import FifoLock
from services.runtime.pipeline.gpu_worker import GpuWorker, wait_disconnect
from services.runtime.pipeline.incoming import Incoming
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.queued import QueuedItem, QueuedRequest
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.pipeline.timing import Timing
from services.runtime.pipeline.warmup import measured_call

__all__ = ["GpuWorker", "QueuedItem", "QueuedRequest", "Scheduler", "wait_disconnect"]
TRIM_AFTER_BYTES = 256 * 2**20   # a call this big hands its freed heap back to the kernel

log = logging.getLogger("onecard.service")


class Scheduler:
    def __init__(self, backend: Backend, settings: ModelServiceSettings, metrics: PipelineMetrics,
                 worker: GpuWorker | None = None, cost: ServiceCost | None = None):
        self.backend, self.settings, self.metrics = backend, settings, metrics
        self.worker = worker or GpuWorker()
        self.lock = FifoLock()
        self.max_batch = settings.max_batch_size if backend.supports_batching else 1
        self.batching = self.max_batch > 1
        self.cost = cost or ServiceCost(backend, self.max_batch)
        cap = None if settings.max_wait_ms is None else settings.max_wait_ms / 1000
        self.policy = BatchPolicy(self.max_batch, cap) if self.batching and settings.batch_policy == "auto" else None
        self._pending: collections.deque[QueuedItem] = collections.deque()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.in_flight = 0
        self.incoming = Incoming()                  # requests decoding, clients about to come back
        self._free_since = time.perf_counter()     # when the model last freed up
        self.last_decision: Decision | None = None
        self.batches = 0
        self.items_run = 0
        self.waited_s = 0.0

    def limit_batch(self, size: int) -> None:
        """At most `size` items per call from now on: warm-up found that a bigger batch runs
        out of memory (see warmup.py). Set before the loop starts."""
        if size >= self.max_batch:
            return
        log.warning("batches limited to %d item(s) (max_batch_size %d): a bigger one ran out of memory at warm-up",
                    max(1, size), self.max_batch)
        self.max_batch = max(1, size)
        self.batching = self.max_batch > 1
        self.cost.curve.max_batch = self.max_batch
        self.policy = None if not self.batching or self.policy is None else BatchPolicy(self.max_batch,
                                                                                        self.policy.cap_s)

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._free_since = time.perf_counter()
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

    # ---- what is coming (the pipeline reports decodes) ----------------------------------
    def decoding_started(self, token: object) -> None:
        self.incoming.decoding(token, time.perf_counter())
        self._wake.set()  # a batch being gathered may now want to wait for it

    def decoding_waits(self, token: object, waiting: bool) -> None:
        """A decoding request waits for memory (True) or has it and decodes again (False)."""
        now = time.perf_counter()
        if waiting:
            self.incoming.decode_paused(token, now)
        else:
            self.incoming.decode_resumed(token, now)
        self._wake.set()

    def decoding_done(self, token: object) -> None:
        self.incoming.decoded(token, time.perf_counter())
        self._wake.set()

    def request_arrived(self, connection: Hashable | None) -> None:
        self.incoming.arrived(connection, time.perf_counter())

    def answering(self, token: object) -> None:
        self.incoming.answering(token, time.perf_counter())

    def answered(self, token: object, connection: Hashable | None) -> None:
        self.incoming.answered(token, connection, time.perf_counter())

    def batching_stats(self) -> dict[str, Any]:
        d = self.last_decision
        return {"policy": self.settings.batch_policy if self.batching else "off", "max_batch_size": self.max_batch,
                "max_wait_ms": self.settings.max_wait_ms, "batches": self.batches,
                "mean_batch_size": round(self.items_run / self.batches, 3) if self.batches else None,
                "waited_s": round(self.waited_s, 3), "last_decision": None if d is None else d.reason,
                "cost": self.cost.snapshot()}

    # ---- the one entry point ----------------------------------------------------------
    async def submit(self, items: list[Any], key: Hashable, timing: Timing, receive: Callable | None,
                     ticket: Ticket | None = None) -> list[Any]:
        """Results for `items`, in order. Raises ApiError (504, 503) or ClientGone."""
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        job = QueuedRequest(items, key, timing.t0 + self.settings.request_timeout_s, now,
                  loop.create_future(), ticket, [None] * len(items), len(items),
                  calls=None if timing.trace is None else [])
        for i, item in enumerate(items):
            self._pending.append(QueuedItem(job, i, self.cost.item_pixels(item)))
        if self.policy is not None:
            self.policy.history.arrived(now, len(items), key)
        self._wake.set()
        gone = asyncio.ensure_future(wait_disconnect(receive)) if receive is not None else None
        try:
            return await self._await_job(job, gone, timing)
        except asyncio.CancelledError:  # the drain ran out of time: stop its work too
            self._abandon(job, "shutdown")
            raise
        except Exception as exc:
            # The failure goes on up with its traceback, whose frames hold the job, which holds
            # the failure: a cycle that kept the request's pictures (and, through the route's
            # frame, its body) until a full collection, minutes on an idle service. The frames
            # below are done; their lines stay for the log, their locals go.
            traceback.clear_frames(exc.__traceback__.tb_next)
            del job
            raise
        finally:
            if gone is not None:
                gone.cancel()

    async def _await_job(self, job: QueuedRequest, gone: asyncio.Future | None, timing: Timing) -> list[Any]:
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

    def _abandon(self, job: QueuedRequest, reason: str) -> None:
        """Nobody waits for this job any more: out of the queue now, told to stop if running."""
        if job.abandoned:
            return
        job.cancel_items()
        self.metrics.dropped.labels(reason).inc()
        if job.started_at is None:
            self._pending = collections.deque(e for e in self._pending if e.job is not job)
        job.future.cancel()  # a no-op when it already has its result or error

    def _stage_times(self, job: QueuedRequest, timing: Timing) -> None:
        if job.started_at is not None:
            timing.add("queue", job.started_at - job.enqueued, end=job.started_at)
            timing.add("infer", job.infer_s, traced=False)
            for start, end, size in job.calls or ():  # one span per model call its items were in
                timing.interval("infer", start, end, **{"onecard.batch.size": size})

    # ---- the batch loop ---------------------------------------------------------------
    def _drop_dead_head(self, now: float) -> None:
        while self._pending:
            head = self._pending[0]
            if head.job.abandoned:
                self._pending.popleft()
                continue
            if head.job.started_at is None and now > head.job.deadline:
                self._pending.popleft()
                self._expire(head.job)
                continue
            return

    def _take_batch(self) -> list[QueuedItem]:
        """The oldest live entry and the compatible ones behind it, in arrival order, as many
        as fit in one call's working memory (the head always goes: what could never fit was
        refused at admission)."""
        now = time.perf_counter()
        self._drop_dead_head(now)
        if not self._pending:
            return []
        key = self._pending[0].job.key
        batch: list[QueuedItem] = []
        pixels = 0
        rest: collections.deque[QueuedItem] = collections.deque()
        for entry in self._pending:
            job = entry.job
            if (len(batch) < self.max_batch and not job.abandoned and job.key == key
                    and (job.started_at is not None or now <= job.deadline)
                    and (not batch or self.cost.call_fits(pixels + entry.pixels))):
                batch.append(entry)
                pixels += entry.pixels
            elif not job.abandoned:
                rest.append(entry)
        self._pending = rest
        return batch

    def _compatible_waiting(self) -> int:
        key = self._pending[0].job.key
        n = 0
        for entry in self._pending:
            if entry.job.key == key and not entry.job.abandoned:
                n += 1
                if n >= self.max_batch:
                    break
        return n

    def _expire(self, job: QueuedRequest) -> None:
        if not job.future.done():
            job.future.set_exception(ApiError(
                504, "deadline_exceeded",
                f"not started within the request deadline of {self.settings.request_timeout_s:g} s"))
        self._abandon(job, "deadline")

    async def _batch_loop(self) -> None:
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            if self.policy is not None:
                await self._gather()
            elif self.settings.max_wait_ms and self.batching:
                await self._fill_window(self.settings.max_wait_ms / 1000)
            batch = self._take_batch()
            if batch:
                await self._run(batch)
            # Bound here, the last batch's requests (their pictures and answers) would live on
            # for as long as the loop waits for the next one: for good on an idle service.
            del batch

    async def _fill_window(self, window: float) -> None:
        """The fixed policy: wait until the head has waited `window` or the batch is full."""
        fill_until = self._pending[0].job.enqueued + window
        while len(self._pending) < self.max_batch:
            left = fill_until - time.perf_counter()
            if left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break

    async def _gather(self) -> None:
        """The auto policy: ask it, after every arrival or decode, whether to wait (batching.py)."""
        assert self.policy is not None
        while True:
            now = time.perf_counter()
            self._drop_dead_head(now)
            if not self._pending:
                return
            head = self._pending[0]
            ratio = self.cost.work_ratio([head.job.items[head.index]])
            seconds = lambda n, ratio=ratio: self.cost.call_seconds(n, ratio)
            waited = now - max(head.job.enqueued, self._free_since)
            decision = self.policy.decide(now, self._compatible_waiting(), head.job.key, now - self._free_since,
                                          waited, self.incoming.etas(now), seconds)
            self.last_decision = decision
            # never wait so long that the head's own deadline passes before its call ends
            slack = head.job.deadline - now - (seconds(1) or 0.0)
            wait = min(decision.wait_s, slack)
            if wait <= 0:
                return
            self._wake.clear()
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass
            took = time.perf_counter() - t0
            self.waited_s += took
            self.metrics.batch_wait.observe(took)

    async def _run(self, batch: list[QueuedItem]) -> None:
        await self.lock.acquire()
        t0 = time.perf_counter()
        try:
            for entry in batch:
                job = entry.job
                if job.started_at is None:
                    job.started_at = t0
                    if job.ticket is not None:
                        job.ticket.started()
            results = await self._infer([e.job.items[e.index] for e in batch], sum(e.pixels for e in batch))
        finally:
            self.lock.release()
            self._free_since = time.perf_counter()
            if self.policy is not None:
                self.policy.history.model_freed(self._free_since, len(batch))
        t1 = time.perf_counter()
        dt = t1 - t0
        self.batches += 1
        self.items_run += len(batch)
        for result in results:
            if isinstance(result, BaseException):
                # done frames only (the call's, the model's): their locals are the batch's pictures
                # and the model's own buffers, and _infer's frame holds the failure (a cycle)
                traceback.clear_frames(result.__traceback__)
        for entry, result in zip(batch, results, strict=False):
            job = entry.job
            job.results[entry.index] = result
            job.infer_s += dt
            if job.calls is not None and (not job.calls or job.calls[-1][0] != t0):
                job.calls.append((t0, t1, len(batch)))
            job.remaining -= 1
            if job.remaining == 0 and not job.future.done():
                failure = next((r for r in job.results if isinstance(r, BaseException)), None)
                if failure is not None:
                    job.future.set_exception(failure)
                else:
                    job.future.set_result(job.results)

    async def _infer(self, payloads: list[Any], pixels: int = 0) -> list[Any]:
        """One model call; a failing batch is retried item by item so a bad item fails alone.
        A clean call (no failure, nobody stopped midway) teaches the cost model its time."""
        # One batch is on the model at a time (the batch loop awaits each), so this is a set.
        self.in_flight = len(payloads)
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.batch_size.observe(len(payloads))
        probe = getattr(self.cost, "probe", None)
        try:
            try:
                results, seconds, peak = await self.worker.run(
                    measured_call, self.backend.infer_batch, payloads, probe if probe is not None and probe.precise
                    else None)
                if len(results) != len(payloads):
                    raise RuntimeError(f"backend returned {len(results)} results for {len(payloads)} items")
                if not any(isinstance(r, BaseException) or r is None for r in results) and not any(
                        getattr(p, "cancel", None) is not None and p.cancel.is_set() for p in payloads):
                    self.cost.observe_call(payloads, seconds, peak)
            except Exception as exc:  # noqa: BLE001
                if len(payloads) == 1:
                    results = [exc]
                else:
                    if is_out_of_memory(exc):
                        await self._free_memory(exc)
                    results = [await self._infer_alone(p) for p in payloads]
            if self.cost.call_bytes(pixels) >= TRIM_AFTER_BYTES and not self.cost.call_on_gpu:
                await self.worker.run(memory.trim_heap, tracked=False)
            out_of_memory = [r for r in results if isinstance(r, BaseException) and not isinstance(r, ApiError)
                             and is_out_of_memory(r)]
            for exc in out_of_memory:
                await self._free_memory(exc)
            return [self._out_of_memory(r) if any(r is e for e in out_of_memory) else r for r in results]
        finally:
            self.in_flight = 0
            self.metrics.in_flight.set(0)

    async def _infer_alone(self, payload: Any) -> Any:
        event = getattr(payload, "cancel", None)
        if isinstance(event, threading.Event) and event.is_set():
            return ClientGone()
        try:
            results = await self.worker.run(self.backend.infer_batch, [payload])
            if len(results) != 1:  # its first would be taken for its own: another item's answer
                raise RuntimeError(f"backend returned {len(results)} results for 1 item")
            return results[0]
        except Exception as exc:  # noqa: BLE001 - this item's own failure
            return exc

    async def _free_memory(self, exc: BaseException) -> None:
        """On the worker: a full collection and the allocator's cache given back are not the
        event loop's work (nor is touching the GPU from another thread than the model's)."""
        log.warning("GPU out of memory: %s", exc)
        # The failed call's frames (done: the model's, the worker's) still hold its tensors
        # through the traceback, so nothing they hold could be given back; their lines stay.
        traceback.clear_frames(exc.__traceback__)
        try:
            await self.worker.run(self.backend.on_out_of_memory, tracked=False)
        except Exception:  # noqa: BLE001 - freeing memory must not turn one 503 into a crash
            log.exception("freeing memory after out-of-memory failed")

    def _out_of_memory(self, exc: BaseException) -> ApiError:
        """The 503 for a call that ran out of memory (freed already, by _free_memory)."""
        self.metrics.dropped.labels("out_of_memory").inc()
        return ApiError(503, "out_of_memory", "the model ran out of GPU memory; retry later",
                        {"Retry-After": str(self.settings.retry_after_s)})

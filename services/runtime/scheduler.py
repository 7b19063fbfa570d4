"""From an admitted request to a model result: queueing, batching, deadlines, disconnects.

Every model call runs on one worker thread (the "GPU worker") and under the
service's FifoLock, so GPU work is serialized in arrival order. Requests wait either
on the lock itself (backends without batching) or in the batch queue, which is FIFO
too; the batch loop then takes the lock for each batch.

A request is dropped before it costs model time when its deadline has passed (504)
or its client has gone; over `max_queue` waiting, it is refused at once (503).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

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


@dataclass
class _Item:
    payload: Any
    deadline: float
    enqueued: float
    future: asyncio.Future
    started: bool = False
    dropped: bool = False


@dataclass
class Scheduler:
    backend: Backend
    settings: RuntimeSettings
    metrics: ServiceMetrics
    worker: GpuWorker = field(default_factory=GpuWorker)

    def __post_init__(self):
        self.lock = FifoLock()  # queue wait is observed per request as the "queue" stage
        self.batching = self.backend.supports_batching and self.settings.max_batch_size > 1
        self._pending: collections.deque[_Item] = collections.deque()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.in_flight = 0

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self.batching:
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self.worker.shutdown()

    def problem(self) -> str | None:
        """Why the model side cannot serve (for /healthz), or None."""
        if self._loop_task is not None and self._loop_task.done():
            return "the batch loop has stopped"
        busy = self.worker.busy_for()
        if busy > self.settings.inference_timeout_s:
            return f"a model call has been running for {busy:.1f} s"
        return None

    @property
    def queue_depth(self) -> int:
        return len(self._pending) if self.batching else self.lock.waiting

    # ---- the one entry point ----------------------------------------------------------
    async def submit(self, payload: Any, timing: Timing, receive: Callable | None) -> Any:
        s = self.settings
        would_wait = self.lock.locked() or self.queue_depth > 0
        if would_wait and self.queue_depth >= s.max_queue:  # max_queue 0: only straight to the model
            self.metrics.dropped.labels("queue_full").inc()
            raise ApiError(503, "overloaded", f"{self.queue_depth} requests are waiting (max_queue {s.max_queue})",
                           {"Retry-After": str(s.retry_after_s)})
        deadline = timing.t0 + s.request_timeout_s
        gone = asyncio.ensure_future(wait_disconnect(receive)) if receive is not None else None
        self.metrics.queue_depth.set(self.queue_depth + 1)
        try:
            if self.batching:
                return await self._submit_batched(payload, deadline, timing, gone)
            return await self._submit_locked(payload, deadline, timing, gone)
        finally:
            if gone is not None:
                gone.cancel()
            self.metrics.queue_depth.set(self.queue_depth)

    def _expired(self, deadline: float) -> ApiError:
        self.metrics.dropped.labels("deadline").inc()
        return ApiError(504, "deadline_exceeded",
                        f"not started within the request deadline of {self.settings.request_timeout_s:g} s")

    async def _submit_locked(self, payload: Any, deadline: float, timing: Timing, gone) -> Any:
        t_wait = time.perf_counter()
        acquire = asyncio.ensure_future(self.lock.acquire(timeout=deadline - time.perf_counter()))
        waiters = {acquire} if gone is None else {acquire, gone}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():  # the client went away while queued
            acquire.cancel()
            await asyncio.gather(acquire, return_exceptions=True)
        if acquire.cancelled():
            self.metrics.dropped.labels("client_gone").inc()
            raise ClientGone()
        if isinstance(acquire.exception(), TimeoutError):
            raise self._expired(deadline)
        acquire.result()  # anything else is a bug: let it surface as a 500
        try:
            timing.add("queue", time.perf_counter() - t_wait)
            self.metrics.stage.labels("queue").observe(time.perf_counter() - t_wait)
            if gone is not None and gone.done():
                self.metrics.dropped.labels("client_gone").inc()
                raise ClientGone()
            if time.perf_counter() > deadline:
                raise self._expired(deadline)
            results, stopped_because = await self._run_cancellable(payload, deadline, timing, gone)
        finally:
            self.lock.release()
        if stopped_because == "client":
            self.metrics.dropped.labels("client_gone").inc()
            raise ClientGone()
        if stopped_because == "deadline":
            self.metrics.dropped.labels("deadline").inc()
            raise ApiError(504, "deadline_exceeded",
                           f"stopped at the request deadline of {self.settings.request_timeout_s:g} s")
        return self._unwrap(results[0])

    async def _run_cancellable(self, payload: Any, deadline: float, timing: Timing, gone) -> tuple[list, str]:
        """Run one item; a payload with a `cancel` event is told to stop (between steps)
        when its client leaves or its deadline passes."""
        run = asyncio.ensure_future(self._run_batch([payload], timing))
        cancel = getattr(payload, "cancel", None)
        if cancel is None:
            return await run, ""
        watch = {run} if gone is None else {run, gone}
        done, _ = await asyncio.wait(watch, timeout=max(0.0, deadline - time.perf_counter()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            return run.result(), ""
        cancel.set()
        why = "client" if gone is not None and gone.done() else "deadline"
        return await run, why

    async def _submit_batched(self, payload: Any, deadline: float, timing: Timing, gone) -> Any:
        item = _Item(payload, deadline, time.perf_counter(), asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._wake.set()
        waiters = {item.future} if gone is None else {item.future, gone}
        await asyncio.wait(waiters, timeout=max(0.0, deadline - time.perf_counter()),
                           return_when=asyncio.FIRST_COMPLETED)
        if not item.future.done() and not item.started:
            item.dropped = True
            try:
                self._pending.remove(item)
            except ValueError:
                pass
            if gone is not None and gone.done():
                self.metrics.dropped.labels("client_gone").inc()
                raise ClientGone()
            raise self._expired(deadline)
        result = await item.future
        timing.stages.update(getattr(item, "timing", {}))
        return self._unwrap(result)

    @staticmethod
    def _unwrap(result: Any) -> Any:
        if isinstance(result, BaseException):
            raise result
        return result

    async def _batch_loop(self) -> None:
        s = self.settings
        while True:
            while not self._pending:
                self._wake.clear()
                await self._wake.wait()
            fill_until = time.perf_counter() + s.max_wait_ms / 1000
            while len(self._pending) < s.max_batch_size:
                left = fill_until - time.perf_counter()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch: list[_Item] = []
            now = time.perf_counter()
            while self._pending and len(batch) < s.max_batch_size:
                item = self._pending.popleft()
                if item.dropped or item.future.done():
                    continue
                if now > item.deadline:
                    item.future.set_result(self._expired(item.deadline))
                    continue
                batch.append(item)
            if not batch:
                continue
            await self.lock.acquire()
            try:
                for item in batch:
                    item.started = True
                    item.timing = {"queue": time.perf_counter() - item.enqueued}  # type: ignore[attr-defined]
                    self.metrics.stage.labels("queue").observe(item.timing["queue"])
                timing = Timing()
                results = await self._run_batch([i.payload for i in batch], timing)
            except Exception as exc:  # noqa: BLE001 - delivered to every waiter of the batch
                results = [exc] * len(batch)
                timing = Timing()
            finally:
                self.lock.release()
            for item, result in zip(batch, results):
                item.timing.update(timing.stages)  # type: ignore[attr-defined]
                if not item.future.done():
                    item.future.set_result(result)

    async def _run_batch(self, payloads: list[Any], timing: Timing) -> list[Any]:
        """One model call; a failing batch is retried item by item so a bad item fails alone."""
        self.in_flight += len(payloads)
        self.metrics.in_flight.set(self.in_flight)
        t0 = time.perf_counter()
        try:
            self.metrics.batch_size.observe(len(payloads))
            try:
                results = await self.worker.run(self.backend.infer_batch, payloads)
            except Exception as exc:  # noqa: BLE001
                if is_out_of_memory(exc):
                    results = [self._oom(exc)] * len(payloads)
                elif len(payloads) == 1:
                    results = [exc]
                else:
                    results = []
                    for p in payloads:
                        try:
                            results.extend(await self.worker.run(self.backend.infer_batch, [p]))
                        except Exception as one:  # noqa: BLE001
                            results.append(self._oom(one) if is_out_of_memory(one) else one)
            return [self._oom(r) if isinstance(r, BaseException) and is_out_of_memory(r) else r for r in results]
        finally:
            dt = time.perf_counter() - t0
            timing.add("infer", dt)
            self.metrics.stage.labels("infer").observe(dt)
            self.in_flight -= len(payloads)
            self.metrics.in_flight.set(self.in_flight)

    def _oom(self, exc: BaseException) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        log.warning("GPU out of memory: %s", exc)
        try:
            self.backend.on_out_of_memory()
        except Exception:  # noqa: BLE001 - freeing memory must not turn one 503 into a crash
            log.exception("freeing memory after out-of-memory failed")
        self.metrics.dropped.labels("out_of_memory").inc()
        return ApiError(503, "out_of_memory", "the model ran out of GPU memory; retry later",
                        {"Retry-After": str(self.settings.retry_after_s)})

"""The jobs service's moving parts, started and stopped together: the queue backend, the
local targets and one consumer per target; plus what the API asks of them (which model a
submit goes to, and the figures for /stats and /metrics)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
from collections.abc import Callable
from typing import Any

from common.hostmemory import trim_heap
from services.jobs.admission import StreamSlots, SubmitBudget
from services.jobs.broker import Broker, ModelInfo, QueueUnavailable
from services.jobs.consumer import Consumer, is_json_document
from services.jobs.helper_pipe import HelperGone, HelperPool
from services.jobs.memory_broker import MemoryBroker
from services.jobs.metrics import STAGES, JobsMetrics
from services.jobs.payload import Digest, Limits, SubmitRequest, digest_submit
from services.jobs.policy import RetryPolicy
from services.jobs.queue_room import QueueRoom
from services.jobs.records import TERMINAL
from services.jobs.registry import Registry
from services.jobs.results import LiveStreams
from services.jobs.settings import JobsSettings
from services.jobs.store_budget import sized_for_memory
from services.jobs.targets import ResultTooLarge, Target, TargetTimeout, TargetUnreachable, unit_services
from services.runtime.codecs.gil_lane import LANE_MIN_BYTES, in_lane, release_on
from services.runtime.device.threads import lower_priority
from services.runtime.errors import ApiError
from services.runtime.shell.heap import freeze_startup_heap

log = logging.getLogger("onecard.jobs")
# smaller payloads are parsed on the loop (a thread hop would cost more): work on fewer bytes
# than this never takes the GIL lane, which the loop must never wait for
INLINE_BYTES = LANE_MIN_BYTES
PROCESS_BYTES = 1024 * 1024  # bigger submits are parsed in a helper process: no GIL held for long here


def make_broker(settings: JobsSettings, node: str, environ=os.environ) -> Broker:
    url = settings.queue.resolved_url(environ)  # StartupConfigError when url_env names a missing variable
    policy = RetryPolicy.from_settings(settings.queue)
    if url is None:
        return MemoryBroker(sized_for_memory(settings, environ), node, settings.max_queued_jobs, policy)
    from services.jobs.redis_broker import RedisBroker  # only units with a queue need redis-py
    return RedisBroker(url, settings.queue, node, settings.max_queued_jobs, policy)


class JobsService:
    def __init__(self, name: str, settings: JobsSettings, environ=os.environ, registry=None, traces=None):
        self.name, self.settings = name, settings
        self.traces = traces  # services.runtime.traces.tracer.Traces, None when traces are off
        self.node = settings.resolved_node_name()
        self.metrics = JobsMetrics(registry)
        self.broker = make_broker(settings, self.node, environ)
        self.broker.on_cancel(self._cancel_running)
        self.broker.on_done(self._job_done)
        self._waiters: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}
        self.draining = False
        self._drain_deadline: float | None = None
        run_timeout = settings.run_timeout_s
        self.targets = [Target(n, t.url, t, run_timeout, settings.dry_run_timeout_s, settings.max_result_bytes)
                        for n, t in unit_services(settings, name, environ).items()]
        self.consumers: dict[str, Consumer] = {}
        self.ready = False
        self.queue_reachable = True
        self.startup_problem: str | None = None
        self._startup_task: asyncio.Task | None = None
        # niced as the services' CPU pools are: JSON pages and base64 wait for the loop, not the reverse
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="onecard-jobs-cpu",
                                                              initializer=lower_priority)
        self.helpers = HelperPool(2)  # big submits and results: processes started on first use
        self._helper_threads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="onecard-jobs-helper",
                                                                    initializer=lower_priority)
        self.submits = SubmitBudget(settings.submit_memory_bytes, settings.retry_after_s, settings.submit_wait_s)
        self.room = QueueRoom(settings.queue_wait_s)
        self.live_streams = LiveStreams(self._trim_heap)
        self.stream_slots = StreamSlots(settings.max_result_streams, settings.retry_after_s,
                                        settings.result_stream_wait_s)
        self.registry = Registry(self.broker, lambda: [t.model_info() for t in self.targets if t.label],
                                 self.metrics, settings.queue.announce_period_s)

    # ---- lifecycle --------------------------------------------------------------------
    def begin(self) -> None:
        self._startup_task = asyncio.get_running_loop().create_task(self._startup(), name="jobs-startup")

    async def _startup(self) -> None:
        delay = 0.1
        while True:
            try:
                await self.broker.start()
                break
            except QueueUnavailable as exc:
                self.startup_problem = f"queue unavailable: {exc}"
                log.warning("jobs: %s; retrying in %.1f s", self.startup_problem, delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
        self.startup_problem = "waiting for the local services"
        await asyncio.gather(*(self._discover(t) for t in self.targets))
        labels = [t.label for t in self.targets]
        dup = {lab for lab in labels if labels.count(lab) > 1}
        if dup:
            self.startup_problem = f"two local services report the same model label {sorted(dup)}"
            log.error("jobs: %s; set model_label per target", self.startup_problem)
            return
        await self._until_queue(self.registry.check)
        self.registry.start()
        if self.settings.consume:
            renew = max(0.1, self.settings.queue.visibility_timeout_s / 3)
            for t in self.targets:
                c = Consumer(self.broker, t, self.settings, self.metrics, renew, self.is_json, self.traces)
                self.consumers[t.label] = c
                c.start()
        self.startup_problem = None
        await asyncio.get_running_loop().run_in_executor(self.executor, freeze_startup_heap)
        self.ready = True
        log.info("jobs: ready (%s); node %s consumes %s", self.broker.mode, self.node,
                 sorted(self.consumers) or "nothing")

    async def _discover(self, t: Target) -> None:
        delay = 0.2
        while True:
            try:
                return await t.discover()
            except (TargetUnreachable, TargetTimeout, ResultTooLarge, ValueError, TypeError, AttributeError) as exc:
                log.warning("jobs: cannot learn %s's model and routes yet (%r); retrying", t.name, exc)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def _until_queue(self, op: Callable) -> Any:
        delay = 0.1
        while True:
            try:
                return await op()
            except QueueUnavailable as exc:
                log.warning("jobs: queue unavailable (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    def begin_drain(self) -> None:
        """SIGTERM: take no new job from now on, wake every long poll; running jobs carry on
        for drain_s (counted from now, not from when the HTTP connections are closed)."""
        if self.draining:
            return
        self.draining = True
        self._drain_deadline = asyncio.get_running_loop().time() + self.settings.resolved_drain_s()
        log.info("jobs: draining: no new jobs; %d running", sum(len(c.running) for c in self.consumers.values()))
        for c in self.consumers.values():
            c.stop_taking()
        for ev in self._waiters.values():
            ev.set()

    async def shutdown(self) -> None:
        self.begin_drain()
        self.ready = False
        if self._startup_task is not None and not self._startup_task.done():
            self._startup_task.cancel()
            await asyncio.gather(self._startup_task, return_exceptions=True)
        drain = max(0.0, self._drain_deadline - asyncio.get_running_loop().time())
        await asyncio.gather(*(c.stop(drain) for c in self.consumers.values()))
        await self.registry.stop()
        for t in self.targets:
            await t.close()
        await self.broker.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._helper_threads.shutdown(wait=False, cancel_futures=True)
        self.helpers.close()

    def problem(self) -> str | None:
        """Why this process cannot do its work (for /healthz), or None."""
        if self._startup_task is not None and self._startup_task.done() and not self._startup_task.cancelled():
            exc = self._startup_task.exception()
            if exc is not None:
                return f"start-up failed: {exc!r}"
        for c in self.consumers.values():
            p = c.problem()
            if p:
                return p
        return None

    def _job_done(self, job_id: str) -> None:
        ev = self._waiters.get(job_id)
        if ev is not None:
            ev.set()

    @property
    def polls_waiting(self) -> int:
        return sum(self._waiting.values())

    async def job(self, job_id: str, wait_s: float) -> dict[str, str] | None:
        """The job's fields, once it is finished or after ``wait_s`` (a long poll; at most
        max_waiting_polls wait at once, the others are answered after a short pause)."""
        if wait_s <= 0 or self.draining:
            return await self.broker.get(job_id)
        if self.polls_waiting >= self.settings.max_waiting_polls:
            return await self._poll_paced(job_id, wait_s)
        ev = self._waiters.setdefault(job_id, asyncio.Event())
        self._waiting[job_id] = self._waiting.get(job_id, 0) + 1
        try:
            found = await self.broker.get(job_id)  # after registering: no finish slips between
            if found is None or found.get("state") in TERMINAL:
                return found
            try:
                await asyncio.wait_for(ev.wait(), wait_s)
            except TimeoutError:
                pass
            return await self.broker.get(job_id)
        finally:
            self._waiting[job_id] -= 1
            if not self._waiting[job_id]:
                del self._waiting[job_id]
                del self._waiters[job_id]

    async def _poll_paced(self, job_id: str, wait_s: float) -> dict[str, str] | None:
        """A long poll beyond max_waiting_polls: a finished (or unknown) job at once, else the
        job as it is after min(wait_s, 0.5-1 x Retry-After). Answered at once, 600 clients
        polling in a loop came straight back, the loop answered nothing else, and /healthz
        waited 200-300 ms; paced, each comes back about once a second at most."""
        found = await self.broker.get(job_id)
        if found is None or found.get("state") in TERMINAL:
            return found
        await asyncio.sleep(min(wait_s, random.uniform(0.5, 1.0) * max(1, self.settings.retry_after_s)))
        return await self.broker.get(job_id)

    def _cancel_running(self, job_id: str) -> None:
        for c in self.consumers.values():
            if c.cancel(job_id):
                return

    async def queue_problem(self) -> str | None:
        """Why the queue cannot take this unit's work now (for /readyz), or None."""
        if not await self.broker.ping():
            return "the job queue cannot be reached"
        refusal = await self.broker.refuses_writes()
        if refusal:
            return f"the job queue refuses writes ({refusal}): no new job can be accepted"
        return None

    async def digest(self, raw: bytes) -> Digest:
        """The submit parsed and checked with the unit's own limits (digest_submit), in a
        helper process when it is big. ``raw`` was read by read_body with max_json_items: its
        items were counted as it arrived and are not counted again (10 ms for 27 MB)."""
        cfg = self.settings
        limits = Limits(cfg.max_image_bytes, cfg.max_pixels)
        if len(raw) > PROCESS_BYTES:
            args = {"max_depth": cfg.max_json_depth, "max_image_bytes": cfg.max_image_bytes,
                    "max_pixels": cfg.max_pixels, "max_items": None}
            done = await self._in_helper("digest", args, raw)
            if done is not None:
                r, body = done[0]["result"], done[1]
                return Digest(r["parsed"], r["service"], r["route"], r["model"], r["priority"], body, r["sha"],
                              [tuple(i) for i in r["images"]], tuple(r["error"]) if r["error"] else None)
        return await self.cpu(len(raw), digest_submit, raw, cfg.max_json_depth, limits, None)

    async def is_json(self, data: bytes) -> bool:
        if len(data) > PROCESS_BYTES:
            done = await self._in_helper("is_json", {}, data)
            if done is not None:
                return bool(done[0]["result"]["is_json"])
        return await self.cpu(len(data), is_json_document, data)

    async def _in_helper(self, fn: str, args: dict[str, Any], data: bytes) -> tuple[dict, bytes] | None:
        """A thread is not enough for big JSON: json.loads and json.dumps of 30 MB hold the
        GIL, and with it the probes, for tens of milliseconds (services.jobs.helper_pipe).
        None when the helper is gone: the caller does it here, this once."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._helper_threads, self.helpers.call,
                                                                    fn, args, data)
        except HelperGone as exc:
            log.warning("jobs: the helper process is gone (%s); starting another", exc)
            return None

    def release(self, garbage: list) -> None:
        """Let big objects go on a worker thread (see CpuPool.release): freeing 30 MB hands
        its pages back to the system, 2 to 3 ms the loop would spend."""
        release_on(self.executor, garbage)

    def _trim_heap(self) -> None:
        """malloc_trim on a worker (tens of ms; ctypes releases the GIL for it)."""
        asyncio.get_running_loop().run_in_executor(self.executor, trim_heap)

    async def cpu(self, size: int, fn: Callable, *args: Any) -> Any:
        """fn(*args): on the loop when it is small, else on a worker, in the GIL lane. This work
        (JSON pages, base64) holds the GIL: two workers at it together left the loop the GIL
        a third of the time (16 clients reading 500-job listings: jobs /healthz p99 122 ms)."""
        if size < INLINE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, in_lane, size, fn, *args)

    # ---- routing a submit ---------------------------------------------------------
    def local(self) -> dict[str, Target]:
        return {t.label: t for t in self.targets if t.label}

    async def known_models(self) -> dict[str, ModelInfo]:
        known = {label: ModelInfo(label, label.split("/", 1)[0]) for label in self.settings.accept_models}
        known.update(await self.broker.models())
        for label, t in self.local().items():
            known[label] = t.model_info()
        return known

    async def resolve(self, req: SubmitRequest | Digest) -> tuple[str, Limits, Target | None]:
        """The model label a submit goes to, the limits its body must meet, and the local
        target when this unit has the model."""
        known = await self.known_models()
        of_service = sorted(lab for lab, m in known.items() if m.service == req.service)
        if not of_service:
            services = sorted({m.service for m in known.values()})
            raise ApiError(422, "unknown_service", f"service: {req.service!r} runs on no unit; known: {services}")
        label = req.model or self.settings.default_models.get(req.service)
        if label is None:
            if len(of_service) > 1:
                raise ApiError(422, "model_required", f"model: {req.service!r} has several models, name one of "
                               f"{of_service[:20]}")
            label = of_service[0]
        info = known.get(label)
        if info is None or info.service != req.service:
            raise ApiError(422, "unknown_model", f"model: {label!r} is not a model of {req.service!r}; "
                           f"known: {of_service[:20]}")
        routes, control = info.routes, set(info.control_routes)
        if routes is None:  # announced by no unit yet: any route one of the service's models serves
            peers = [m for m in known.values() if m.service == req.service and m.routes is not None]
            routes = sorted({r for m in peers for r in m.routes}) if peers else None
            control = {r for m in peers for r in m.control_routes}
        if req.route in control:
            raise ApiError(422, "not_a_job_route", f"route: POST {req.route} of {req.service!r} takes no JSON body: "
                           "it acts on the service (a control route), not on a job's input; call the service "
                           f"directly. Job routes: {routes}")
        if routes is not None and req.route not in routes:
            raise ApiError(422, "unknown_route", f"route: {req.route!r} is not a job route of {req.service!r} "
                           f"({label}); routes: {routes}")
        max_pixels = min(self.settings.max_pixels, int(info.limits.get("max_pixels") or self.settings.max_pixels))
        max_body = info.limits.get("max_body_bytes")
        limits = Limits(self.settings.max_image_bytes, max_pixels, int(max_body) if max_body else None)
        return label, limits, self.local().get(label)

    # ---- figures ----------------------------------------------------------------------
    async def streams(self) -> list[dict[str, Any]]:
        labels = sorted(self.consumers) if self.consumers else sorted(self.local())
        try:
            rows = await self.broker.stream_stats(labels)
        except QueueUnavailable:
            self.queue_reachable = False
            return []
        self.queue_reachable = True
        for row in rows:
            c = self.consumers.get(row["model"])
            row["in_progress"] = len(c.running) if c else 0
        return rows

    def stages(self) -> dict[str, Any]:
        return {stage: self.metrics.percentiles(stage) for stage in STAGES}

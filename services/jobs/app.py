"""The jobs service's app factory (``services.jobs.app:create_app``): the jobs API plus the
probes and figures every onecard service answers (/healthz, /readyz, /info, /stats,
/metrics), the optional API key and the instance header."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import sys
import threading
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from services.jobs.api import add_routes
from services.jobs.service import JobsService
from services.jobs.settings import JobsSettings
from services.runtime.errors import error_response, install_error_handlers

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/stats"})


class JobsMiddleware:
    """Pure ASGI: the API key (constant-time compare) and X-Onecard-Instance on every answer."""

    def __init__(self, app, key: str | None, instance: str | None):
        self.app, self.key = app, key.encode() if key else None
        self.instance = instance.encode() if instance else None

    def _authorized(self, scope) -> bool:
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"x-api-key":
                given = value
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_instance(message):
            if message["type"] == "http.response.start" and self.instance:
                message = {**message, "headers": [*message.get("headers", ()), (b"x-onecard-instance", self.instance)]}
            await send(message)

        if self.key and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            resp = error_response(401, "unauthorized", "missing or wrong API key (Authorization: Bearer or X-API-Key)",
                                  {"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send_with_instance)
        await self.app(scope, receive, send_with_instance)


def on_stop_signal(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` on the loop as soon as SIGTERM or SIGINT arrives, before the server's own
    handling (which first waits for open HTTP requests, then runs the lifespan shutdown): a
    draining unit must stop taking jobs at once. The handler only enqueues, then hands the
    signal on to the handler it replaced. Returns a function that puts that handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals reach the main thread only; an embedded server has no stop signal
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        loop.call_soon_threadsafe(callback)
        prev = previous[signum]
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:  # what the signal would have done without us
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, prev in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, prev)
    return restore


def create_app(settings: dict[str, Any]) -> FastAPI:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cfg = JobsSettings.model_validate(settings)
    name = os.environ.get("ONECARD_SERVICE_NAME", "jobs")
    instance = os.environ.get("ONECARD_INSTANCE_TOKEN")
    svc = JobsService(name, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.begin()
        restore = on_stop_signal(asyncio.get_running_loop(), svc.begin_drain)
        try:
            yield
        finally:
            await svc.shutdown()
            restore()

    app = FastAPI(title="onecard jobs", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.jobs = svc
    install_error_handlers(app)
    ident = {"instance": instance, "pid": os.getpid()}

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        problem = svc.problem()
        if problem:
            return JSONResponse({"status": "failing", "reason": problem, **ident}, status_code=503)
        return {"status": "ok", **ident}

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        if svc.draining:
            return JSONResponse({"ready": False, "reason": "draining", **ident}, status_code=503)
        if not svc.ready:
            return JSONResponse({"ready": False, "reason": svc.startup_problem or "starting", **ident},
                                status_code=503)
        if not await svc.broker.ping():
            return JSONResponse({"ready": False, "reason": "the job queue cannot be reached", **ident},
                                status_code=503)
        return {"ready": True, **ident}

    @app.get("/info")
    async def info():
        try:
            known = sorted(await svc.known_models()) if svc.ready else []
        except Exception:  # noqa: BLE001 - /info must answer while the queue is away
            known = []
        return {
            "service": name, "node": svc.node, "ready": svc.ready, **ident,
            "queue": svc.broker.describe(),
            "model_labels": sorted(svc.consumers),
            "targets": [{"name": t.name, "url": t.url, "model_label": t.label or None, "routes": t.routes,
                         "max_in_flight": t.max_in_flight, "dry_run": t.dry_run_supported, "up": t.up}
                        for t in svc.targets],
            "known_models": known,
            "limits": {k: getattr(cfg, k) for k in ("max_body_bytes", "max_image_bytes", "max_pixels",
                                                    "max_queued_jobs", "run_timeout_s")},
        }

    @app.get("/stats", include_in_schema=False)
    async def stats():
        streams = await svc.streams()
        running = svc.metrics.percentiles("running")
        counts = svc.metrics.counts
        return {
            "queue_depth": sum(s["lag"] for s in streams),
            "in_flight": sum(len(c.running) for c in svc.consumers.values()),
            "served": counts["succeeded"],
            "errors": counts["failed"],
            "latency_p50_ms": running["p50_ms"],
            "latency_p99_ms": running["p99_ms"],
            "jobs": {"mode": svc.broker.mode, "node": svc.node, "queue_reachable": svc.queue_reachable,
                     "streams": streams, "stages": svc.stages(), "counts": dict(counts)},
        }

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return Response(svc.metrics.exposition(await svc.streams()), media_type="text/plain; version=0.0.4")

    add_routes(app, svc)
    app.add_middleware(JobsMiddleware, key=cfg.resolved_api_key(), instance=instance)
    return app

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
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from services.jobs.api import add_routes
from services.jobs.api_admin import add_admin_routes
from services.jobs.service import JobsService
from services.jobs.settings import JobsSettings
from services.runtime.errors import ClientGone, error_response, install_error_handlers
from services.runtime.edge.probe_listener import Heartbeat, ProbeServer, json_route

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/stats"})
METRICS_TYPE = "text/plain; version=0.0.4"
ON_LOOP_TIMEOUT_S = 3.0


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
        loop = asyncio.get_running_loop()
        loop_box.append(loop)
        heartbeat.start(loop)
        await asyncio.to_thread(probes.start)
        svc.begin()
        restore = on_stop_signal(asyncio.get_running_loop(), svc.begin_drain)
        try:
            yield
        finally:
            await svc.shutdown()
            restore()
            heartbeat.stop()
            await asyncio.to_thread(probes.stop)

    app = FastAPI(title="onecard jobs", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.jobs = svc
    # what services.runtime.serve reads: the connection limits, and `draining` set on SIGTERM
    app.state.ctx = SimpleNamespace(settings=cfg, draining=False)
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _gone(request, exc):  # left mid-upload: nobody reads this, and it is not our failure to log
        return error_response(499, "client_closed", "the client closed the connection before its answer")
    ident = {"instance": instance, "pid": os.getpid()}

    heartbeat = Heartbeat()

    def health() -> tuple[int, dict]:  # in the probe thread too: reads only, never awaits
        problem = svc.problem() or heartbeat.problem(cfg.loop_stall_s)
        if problem:
            return 503, {"status": "failing", "reason": problem, **ident}
        return 200, {"status": "ok", **ident}

    async def readiness() -> tuple[int, dict]:
        if svc.draining:
            return 503, {"ready": False, "reason": "draining", **ident}
        if not svc.ready:
            return 503, {"ready": False, "reason": svc.startup_problem or "starting", **ident}
        problem = await svc.queue_problem()
        if problem:
            return 503, {"ready": False, "reason": problem, **ident}
        return 200, {"ready": True, **ident}

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        status, doc = health()
        return JSONResponse(doc, status_code=status)

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        status, doc = await readiness()
        return JSONResponse(doc, status_code=status)

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
            "registry": svc.registry.describe(),
            "limits": {k: getattr(cfg, k) for k in ("max_body_bytes", "max_image_bytes", "max_pixels",
                                                    "max_queued_jobs", "run_timeout_s", "max_json_depth",
                                                    "max_result_bytes", "result_reserve_bytes",
                                                    "submit_memory_bytes", "max_result_streams",
                                                    "max_list_limit")},
        }

    async def stats_doc() -> tuple[int, dict]:
        streams = await svc.streams()
        running = svc.metrics.percentiles("running")
        counts = svc.metrics.counts
        return 200, {
            "queue_depth": sum(s["lag"] for s in streams),
            "in_flight": sum(len(c.running) for c in svc.consumers.values()),
            "served": counts["succeeded"],
            "errors": counts["failed"],
            "latency_p50_ms": running["p50_ms"],
            "latency_p99_ms": running["p99_ms"],
            "jobs": {"mode": svc.broker.mode, "node": svc.node, "queue_reachable": svc.queue_reachable,
                     "queue_refuses_writes": svc.broker.refusal, "queue_data_lost_at": svc.registry.data_lost_at,
                     "streams": streams, "stages": svc.stages(), "counts": dict(counts)},
        }

    async def exposition() -> bytes:
        return svc.metrics.exposition(await svc.streams(), svc.broker.refusals, svc.broker.refusal)

    @app.get("/stats", include_in_schema=False)
    async def stats():
        return (await stats_doc())[1]

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return Response(await exposition(), media_type=METRICS_TYPE)

    # The supervisor probes the private unix socket, served from its own thread: clients
    # holding every connection of the public port cannot make this unit look dead.
    loop_box: list[asyncio.AbstractEventLoop] = []

    def on_loop(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        if not loop_box:
            raise RuntimeError("the service has not started")
        return asyncio.run_coroutine_threadsafe(coro_fn(), loop_box[0]).result(ON_LOOP_TIMEOUT_S)

    def from_loop(coro_fn, waiting_doc: dict) -> Callable[[], tuple[int, dict]]:
        def route() -> tuple[int, dict]:
            try:
                return on_loop(coro_fn)
            except Exception as exc:  # noqa: BLE001 - a probe answers; it never raises
                return 503, {**waiting_doc, "reason": f"the event loop did not answer: {type(exc).__name__}", **ident}
        return route

    def metrics_route() -> tuple[int, str, bytes]:
        try:
            return 200, METRICS_TYPE, on_loop(exposition)
        except Exception as exc:  # noqa: BLE001
            return 503, "text/plain", f"the event loop did not answer: {type(exc).__name__}\n".encode()

    probes = ProbeServer({"/healthz": json_route(health),
                          "/readyz": json_route(from_loop(readiness, {"ready": False})),
                          "/stats": json_route(from_loop(stats_doc, {})),
                          "/metrics": metrics_route},
                         unix_path=os.environ.get("ONECARD_PROBE_SOCKET") or None)

    add_routes(app, svc)
    add_admin_routes(app, svc)
    app.add_middleware(JobsMiddleware, key=cfg.resolved_api_key(), instance=instance)
    return app

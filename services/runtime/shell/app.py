"""The one service shell: what every onecard service is made of, the jobs service included.

``ServiceShell(name, settings, part).app()`` builds the FastAPI app that
services.runtime.serve runs. The shell brings, the same way for every service:

- the probes (/healthz, /readyz, /stats, /metrics) on the app and on their own listener
  (services.runtime.edge.probe_listener), answered with the instance token and the pid
  so that the supervisor knows it reached this very process; /healthz also fails when the
  event loop stalls (the heartbeat) or the part says it is stuck;
- the drain: /readyz turns 503 the moment the stop signal arrives;
- auth (API key, HTTP Basic) and the failure limiter in front of it, so that an app built
  in-process has them too; the per-request metrics and the optional access log;
- one error envelope, /info, the OpenAPI document with its security schemes and /docs
  served offline; one Prometheus registry.

A service adds a ``ServicePart`` (services.runtime.shell.part): its routes, its start
(load and warm up a model; start consumers) and its side of the probes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.runtime.edge.auth_failures import AuthFailureGate, FailureLimiter
from services.runtime.edge.connection_limits import ConnectionStats
from services.runtime.edge.credentials import Credentials
from services.runtime.edge.probe_listener import ProbeServer, json_route
from services.runtime.errors import ApiError, ClientGone, error_responses
from services.runtime.settings import ServiceSettings
from services.runtime.shell.api_docs import install_openapi
from services.runtime.shell.error_handlers import error_response, install_error_handlers
from services.runtime.shell.heartbeat import Heartbeat
from services.runtime.shell.metrics import METRICS_TYPE, ShellMetrics, version
from services.runtime.shell.middleware import PROBE_PATHS, ShellMiddleware
from services.runtime.shell.part import ServicePart
from services.runtime.traces.setup import traces_from_environment

log = logging.getLogger("onecard.service")
OPEN_PATHS = PROBE_PATHS | {"/openapi.json", "/docs", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"}
INSTANCE_HEADER = "X-Onecard-Instance"
ON_LOOP_TIMEOUT_S = 3.0  # a probe waits this long for an answer computed on the event loop


class ServiceShell:
    def __init__(self, name: str, settings: ServiceSettings, part: ServicePart):
        self.name = name
        self.settings = settings
        self.part = part
        self.metrics = ShellMetrics(name, ConnectionStats)
        # None unless the OTEL_* variables ask for traces (services.runtime.traces)
        self.traces = traces_from_environment(name, version())
        self.credentials = Credentials.from_settings(settings)
        self.limiter = FailureLimiter(settings.auth_max_failures, settings.auth_failure_window_s)
        self.heartbeat = Heartbeat()
        self.instance = os.environ.get("ONECARD_INSTANCE_TOKEN", "")
        self.pid = os.getpid()
        self.started = False
        self.draining = False
        self.open_paths = OPEN_PATHS | part.open_paths
        # where a family of routes answers errors in its own shape (the webui's): an exact
        # path, or a prefix ending in "/"; 401s included
        self.error_shapes: dict[str, Callable[[ApiError], dict]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.own_middleware: tuple = ()  # what app() adds; any other is the service's own
        self.probes = ProbeServer({"/healthz": json_route(self.health),
                                   "/readyz": json_route(self._from_probe_thread(self.readiness, {"ready": False})),
                                   "/stats": json_route(self._from_probe_thread(self.stats, {})),
                                   "/metrics": self._metrics_from_probe_thread},
                                  unix_path=os.environ.get("ONECARD_PROBE_SOCKET") or None)
        part.bind(self)

    # ---- identity and probe answers -----------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return {"instance": self.instance, "pid": self.pid}

    def health(self) -> tuple[int, dict]:
        """Thread-safe: answered from the probe listener's thread too."""
        problem = self.part.problem() or self.heartbeat.problem(self.settings.loop_stall_s)
        if problem:
            return 503, {"status": "stuck", "reason": problem, **self.identity()}
        return 200, {"status": "ok", **self.identity()}

    def readiness(self) -> Any:
        """(status, doc), or a coroutine of it when the part answers on the event loop."""
        if self.draining:
            return self._readiness_doc("draining")
        reason = self.part.readiness()
        if inspect.isawaitable(reason):
            async def later() -> tuple[int, dict]:
                return self._readiness_doc(await reason)
            return later()
        return self._readiness_doc(reason)

    def _readiness_doc(self, reason: str | None) -> tuple[int, dict]:
        if reason is None and not self.started:
            reason = "starting"
        if reason:
            return 503, {"ready": False, "reason": reason, **self.identity()}
        return 200, {"ready": True, **self.identity()}

    def stats(self) -> Any:
        """(status, doc), or a coroutine of it when the part answers on the event loop."""
        doc = self.part.stats()
        if inspect.isawaitable(doc):
            async def later() -> tuple[int, dict]:
                return 200, {**await doc, **self.identity()}
            return later()
        return 200, {**doc, **self.identity()}

    async def exposition(self) -> bytes:
        """The registry's text; the part's figures brought up to date first, on the loop when
        its hook is a coroutine function, else off it with the rest (psutil, NVML)."""
        if inspect.iscoroutinefunction(self.part.before_scrape):
            await self.part.before_scrape()
            return await asyncio.to_thread(self.metrics.exposition)

        def scrape() -> bytes:
            self.part.before_scrape()
            return self.metrics.exposition()
        return await asyncio.to_thread(scrape)

    def error_shape_for(self, path: str) -> Callable[[ApiError], dict] | None:
        shape = self.error_shapes.get(path)
        if shape is None:
            shape = next((fn for key, fn in self.error_shapes.items() if key.endswith("/") and path.startswith(key)),
                         None)
        return shape

    def error_answer(self, exc: ApiError, path: str) -> JSONResponse:
        shape = self.error_shape_for(path)
        if shape is not None:
            return JSONResponse(shape(exc), status_code=exc.status, headers=exc.headers)
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    def begin_drain(self) -> None:
        """The stop signal arrived: readiness turns 503 now; the part is told on the loop.
        Called from a signal handler: it only sets a flag and enqueues."""
        self.draining = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.part.begin_drain)

    # ---- the probe listener's thread ----------------------------------------------------
    def _wait_on_loop(self, value: Any) -> Any:
        """A value computed in the probe thread, or the coroutine's result from the event loop."""
        if not inspect.isawaitable(value):
            return value
        loop = self.loop
        if loop is None:
            value.close()
            raise RuntimeError("the service has not started")
        return asyncio.run_coroutine_threadsafe(value, loop).result(ON_LOOP_TIMEOUT_S)

    def _from_probe_thread(self, fn: Callable, waiting_doc: dict) -> Callable[[], tuple[int, dict]]:
        def route() -> tuple[int, dict]:
            try:
                return self._wait_on_loop(fn())
            except Exception as exc:  # noqa: BLE001 - a probe answers; it never raises
                return 503, {**waiting_doc, "reason": f"the event loop did not answer: {type(exc).__name__}",
                             **self.identity()}
        return route

    def _metrics_from_probe_thread(self) -> tuple[int, str, bytes]:
        try:
            self._wait_on_loop(self.part.before_scrape())
            return 200, METRICS_TYPE, self.metrics.exposition()
        except Exception as exc:  # noqa: BLE001
            return 503, "text/plain", f"the event loop did not answer: {type(exc).__name__}\n".encode()

    # ---- the app ------------------------------------------------------------------------
    def app(self) -> FastAPI:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        part = self.part

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.loop = asyncio.get_running_loop()
            self.heartbeat.start(self.loop)
            await asyncio.to_thread(self.probes.start)
            try:
                try:  # built before any request can ask (routes are all added by now)
                    await openapi_ready()
                except Exception:  # noqa: BLE001 - a schema that will not build breaks /openapi.json, not the service
                    log.exception("the OpenAPI document cannot be built")
                await part.start(self)
                self.started = True
                yield
            finally:
                self.started = False
                await part.stop()
                if self.traces is not None:  # the last spans, bounded: an absent collector never holds the drain
                    await asyncio.to_thread(self.traces.shutdown)
                await asyncio.to_thread(self.probes.stop)
                self.heartbeat.stop()

        # every route can answer these; a part's routes list their own 4xx besides
        common_errors = error_responses((401, 500, 503) if self.credentials.required else (500, 503))
        app = FastAPI(title=part.title, description=part.description, version=version(), lifespan=lifespan,
                      docs_url=None, redoc_url=None, openapi_url=None, responses=common_errors,
                      **FASTAPI_TELEMETRY_OFF)  # /openapi.json: api_docs.install_openapi
        app.state.shell = self
        install_error_handlers(app)

        def probe_answer(status: int, doc: dict) -> Response:
            return JSONResponse(doc, status_code=status)

        @app.get("/healthz", include_in_schema=False)
        async def healthz():
            return probe_answer(*self.health())

        @app.get("/readyz", include_in_schema=False)
        async def readyz():
            return probe_answer(*await _maybe_await(self.readiness()))

        @app.get("/stats", include_in_schema=False)
        async def stats():
            return probe_answer(*await _maybe_await(self.stats()))

        @app.get("/metrics", include_in_schema=False)
        async def metrics():
            return Response(await self.exposition(), media_type=METRICS_TYPE)

        @app.get("/info", summary="What this service runs, its limits and versions", tags=["service"])
        async def info() -> dict[str, Any]:
            return await part.info()

        # before the part's routes: a path pattern of theirs ("/{name}") must not take these
        openapi_ready = install_openapi(app, self.credentials)
        part.add_routes(app, self)
        added_by_part = len(app.user_middleware)
        if self.traces is not None:  # inside the shell's middleware: credentials are checked before a span
            app.add_middleware(self.traces.middleware(), traces=self.traces, skip_paths=PROBE_PATHS)
        app.add_middleware(ShellMiddleware, shell=self)
        # outermost: it sees every 401, whoever answers it
        app.add_middleware(AuthFailureGate, limiter=self.limiter)
        # each is inserted first: the shell's are ahead of any the part added
        self.own_middleware = tuple(app.user_middleware[:len(app.user_middleware) - added_by_part])

        @app.exception_handler(ClientGone)
        async def _gone(request: Request, exc: ClientGone):
            return error_response(499, "client_closed", "the client closed the connection before its answer")

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, exc: ApiError):
            return self.error_answer(exc, request.url.path)

        return app


def _fastapi_telemetry_off() -> dict[str, Any]:
    """FastAPI's own telemetry (FastAPI(telemetry=...), newer releases) turned off where it exists:
    once a tracer provider is set it traces every request outside every middleware, before the
    credential check, and with FASTAPI_OTEL_AUTO_CONFIGURE=true it would set up exporters of
    its own. A service's traces are the shell's (services.runtime.traces), behind the check."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                          "auto_configure": False}}


FASTAPI_TELEMETRY_OFF = _fastapi_telemetry_off()


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value

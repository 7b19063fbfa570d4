"""One server span per request, as pure ASGI (no task per request).

It sits inside the shell's middleware: the edge's limits and the credential check come
first, so a client that is refused there costs no span and cannot choose a parent. The
caller's W3C traceparent/tracestate make the span a child of the caller's. The pipeline's
stages, recorded while the request ran (stages.py), become child spans when the answer
has been sent. HTTP attributes follow the stable semantic conventions.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.runtime.traces.stages import RequestStages, current_stages

if TYPE_CHECKING:
    from services.runtime.traces.tracer import Traces


class TraceMiddleware:
    def __init__(self, app, traces: Traces, skip_paths: frozenset[str] = frozenset()):
        self.app, self.traces, self.skip_paths = app, traces, skip_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            return await self.app(scope, receive, send)
        wall0, perf0 = time.time_ns(), time.perf_counter()
        method = scope["method"]
        span = self.traces.start(method, self._caller(scope), SpanKind.SERVER, self._attributes(scope), wall0)
        stages = RequestStages()
        token = current_stages.set(stages)
        status = [0]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                await self.app(scope, receive, send_status)
        except Exception as exc:
            span.record_exception(exc)
            status[0] = status[0] or 500  # what the server error middleware outside answers
            raise
        finally:
            current_stages.reset(token)
            self._end(span, scope, method, status[0], stages, wall0, perf0)

    @staticmethod
    def _caller(scope):
        fields = propagate.get_global_textmap().fields
        carrier = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key in fields:
                carrier[key] = value.decode("latin-1")
        return propagate.extract(carrier) if carrier else None

    @staticmethod
    def _attributes(scope) -> dict:
        attrs = {"http.request.method": scope["method"], "url.path": scope["path"],
                 "url.scheme": scope.get("scheme", "http"),
                 "network.protocol.version": scope.get("http_version", "1.1")}
        server, client = scope.get("server"), scope.get("client")
        if server:
            attrs["server.address"], attrs["server.port"] = server[0], server[1] or 0
        if client:
            attrs["client.address"], attrs["client.port"] = client[0], client[1]
        for name, value in scope["headers"]:
            if name == b"user-agent":
                attrs["user_agent.original"] = value.decode("latin-1")[:256]
                break
        return attrs

    def _end(self, span, scope, method: str, status: int, stages: RequestStages, wall0: int, perf0: float) -> None:
        route = getattr(scope.get("route"), "path", None)
        if route:
            span.update_name(f"{method} {route}")
            span.set_attribute("http.route", route)
        if status:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:  # a 4xx is the caller's fault, not this server's
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
        else:  # cancelled before an answer: the client left or the drain cut it
            span.set_attribute("error.type", "no_response")
        parent = trace.set_span_in_context(span)
        for stage, start, end, attrs in stages.intervals:
            self.traces.interval(stage, parent, wall0 + int((start - perf0) * 1e9), wall0 + int((end - perf0) * 1e9),
                                 {"onecard.stage": stage, **attrs})
        span.end()

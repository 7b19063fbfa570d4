"""The request pipeline every model route goes through, and the hooks a service fills in.

    auth (middleware) -> admit (queue slot or 503) -> read body (loop, limits)
      -> decode hook (CPU pool) -> queue, batch, infer (GPU worker) -> encode hook (CPU pool)
      -> respond with Server-Timing

A service declares a ``ModelRoute``: ``decode(raw) -> Work`` turns the raw request into
model items and a batching key (parse parameters, decode images); ``encode(work,
results, raw) -> Reply`` turns results into bytes. Both run in the CPU pool, never on
the event loop. Limits, admission, deadlines, disconnects, metrics and the dry run
(``X-Onecard-Dry-Run: 1``: everything up to the model, then ``{"valid": true}``) hold
for every route alike, webui routes included.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.runtime.body import RawRequest, media_type, query_params, read_body
from services.runtime.codec import Timing
from services.runtime.errors import ApiError, error_responses

if TYPE_CHECKING:
    from services.runtime.app import ServiceContext

DRY_RUN_HEADER = "x-onecard-dry-run"


class CpuPool:
    """The bounded executor for decode, encode, base64 and other CPU work."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="onecard-cpu")

    async def run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Work:
    """What decode hands on: the model items, their batching key, and anything encode needs."""
    items: list[Any]
    key: Hashable = None
    state: Any = None


@dataclass
class Reply:
    body: bytes
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200


def json_reply(doc: Any, headers: dict[str, str] | None = None) -> Reply:
    return Reply(json.dumps(doc, separators=(",", ":")).encode(), "application/json", headers or {})


@dataclass
class ModelRoute:
    path: str
    decode: Callable[[RawRequest], Work]
    encode: Callable[[Work, list[Any], RawRequest], Reply]
    summary: str = ""
    description: str = ""
    request_body: dict[str, Any] | None = None       # OpenAPI requestBody
    responses: dict[int | str, Any] = field(default_factory=dict)
    parameters: list[dict[str, Any]] = field(default_factory=list)  # OpenAPI query parameters
    tags: list[str] = field(default_factory=list)
    error_body: Callable[[ApiError], dict] | None = None  # a route-specific error shape (webui)


class Pipeline:
    def __init__(self, ctx: "ServiceContext"):
        self.ctx = ctx
        self.routes: dict[str, ModelRoute] = {}

    def add(self, app: FastAPI, route: ModelRoute) -> None:
        self.routes[route.path] = route

        async def endpoint(request: Request) -> Response:
            return await self.handle(request, route)

        openapi: dict[str, Any] = {}
        if route.request_body is not None:
            openapi["requestBody"] = route.request_body
        if route.parameters:
            openapi["parameters"] = route.parameters
        app.add_api_route(route.path, endpoint, methods=["POST"], summary=route.summary,
                          description=route.description, tags=route.tags or None,
                          responses={**error_responses(), **route.responses}, openapi_extra=openapi or None,
                          response_class=Response)

    async def handle(self, request: Request, route: ModelRoute) -> Response:
        ctx = self.ctx
        timing = Timing()
        if not ctx.ready or ctx.scheduler is None:
            raise ApiError(503, "not_ready", "the model is still loading", {"Retry-After": "5"})
        ticket = ctx.admission.admit()
        try:
            body = await read_body(request, ctx.settings.max_body_bytes)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
            ctype = headers.get("content-type", "")
            raw = RawRequest(request.method, route.path, query_params(request), headers, media_type(ctype), ctype,
                             body)
            t0 = time.perf_counter()
            try:
                work = await ctx.cpu.run(route.decode, raw)
            finally:
                dt = time.perf_counter() - t0
                timing.add("decode", dt)
                ctx.metrics.stage.labels(route.path, "decode").observe(dt)
            if headers.get(DRY_RUN_HEADER, "").strip() in ("1", "true"):
                ticket.release()
                return self._respond(json_reply({"valid": True, "items": len(work.items)}), timing)
            try:
                results = await ctx.scheduler.submit(work.items, work.key, timing, request.receive, ticket)
            except asyncio.CancelledError:
                if not ctx.draining:
                    raise
                # the drain ran out of time: say so, retryably, instead of uvicorn's plain 500
                raise ApiError(503, "shutting_down", "the service stopped before this request finished; retry",
                               {"Retry-After": str(ctx.settings.retry_after_s), "Connection": "close"}) from None
            ctx.metrics.stage.labels(route.path, "queue").observe(timing.stages.get("queue", 0.0))
            ctx.metrics.stage.labels(route.path, "infer").observe(timing.stages.get("infer", 0.0))
            t1 = time.perf_counter()
            try:
                reply = await ctx.cpu.run(route.encode, work, results, raw)
            finally:
                dt = time.perf_counter() - t1
                timing.add("encode", dt)
                ctx.metrics.stage.labels(route.path, "encode").observe(dt)
        finally:
            ticket.release()
        return self._respond(reply, timing)

    @staticmethod
    def _respond(reply: Reply, timing: Timing) -> Response:
        headers = {**reply.headers, "Server-Timing": timing.header()}
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=headers)

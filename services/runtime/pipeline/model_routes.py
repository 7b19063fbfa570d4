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
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.runtime.edge.body import RawRequest, media_type, query_params, read_body
from services.runtime.codecs.images import Base64Text, Timing
from services.runtime.pipeline.budgets import Charge
from services.runtime.pipeline.cost import DryRunComplete, RequestCost
from services.runtime.errors import ApiError, error_responses
from services.runtime.device.threads import lower_priority

if TYPE_CHECKING:
    from services.runtime.shell.app import ServiceContext

DRY_RUN_HEADER = "x-onecard-dry-run"


class CpuPool:
    """The bounded executor for decode, encode, base64 and other CPU work."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="onecard-cpu",
                                                           initializer=lower_priority)

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
    body: bytes | list[bytes]      # a list is sent part after part (no joined copy)
    media_type: str
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200


SPLICE_OVER = 64 * 1024
SPLICE_STEP = 1 << 20


def json_parts(doc: Any) -> list[bytes]:
    """Compact JSON, as a list of byte strings to send one after the other. Big base64
    strings we produced (codec.Base64Text) are spliced in rather than scanned by json.dumps:
    27 MB of base64 took json.dumps 40 ms with the GIL held, which stalled the event loop
    and the probes; nor is the answer joined into one more copy."""
    big: list[str] = []
    mark = f"onecard-splice-{secrets.token_hex(8)}-"  # no caller's string can hold it

    def swap(node: Any) -> Any:
        if isinstance(node, Base64Text) and len(node) > SPLICE_OVER:
            big.append(node)
            return f"{mark}{len(big) - 1}"
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [swap(v) for v in node]
        return node

    skeleton = json.dumps(swap(doc), separators=(",", ":"))
    if not big:
        return [skeleton.encode()]
    pieces = skeleton.split(mark)
    parts = [pieces[0].encode()]
    for piece in pieces[1:]:
        index, _, rest = piece.partition('"')
        text = big[int(index)]
        parts += [text[i:i + SPLICE_STEP].encode("ascii") for i in range(0, len(text), SPLICE_STEP)]
        parts += [b'"', rest.encode()]
    return parts


def json_bytes(doc: Any) -> bytes:
    return b"".join(json_parts(doc))


def json_reply(doc: Any, headers: dict[str, str] | None = None) -> Reply:
    parts = json_parts(doc)
    return Reply(parts[0] if len(parts) == 1 else parts, "application/json", headers or {})


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
        scheduler = ctx.scheduler
        ticket = ctx.admission.admit()
        charge = scheduler.cost.new_charge()
        try:
            body = await read_body(request, ctx.settings.max_body_bytes, lambda n: charge.hold(n, "the body"))
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
            ctype = headers.get("content-type", "")
            dry_run = is_dry_run(headers)
            raw = RawRequest(request.method, route.path, query_params(request), headers, media_type(ctype), ctype,
                             body)
            raw.cost = RequestCost(scheduler.cost, charge, len(body), dry_run=dry_run)
            work = await self._decode(route, raw, timing)
            if work is None:  # a dry run that the hook ended after its cost check
                return self._respond(json_reply(self._dry_run_doc(raw, None)), timing, charge)
            if raw.cost.estimate is None:  # a hook that stated no cost: what its items say
                await ctx.cpu.run(lambda: raw.cost.check(
                    items=len(work.items), item_pixels=[scheduler.cost.item_pixels(i) for i in work.items],
                    dry_run_stops_here=False))
            if dry_run:
                return self._respond(json_reply(self._dry_run_doc(raw, work)), timing, charge)
            try:
                results = await scheduler.submit(work.items, work.key, timing, request.receive, ticket)
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
            del work, results, raw, body
            charge.account(reply_size(reply))  # only the answer is held now, until it is sent
        except BaseException:
            charge.close()
            raise
        finally:
            ticket.release()
        return self._respond(reply, timing, charge)

    async def _decode(self, route: ModelRoute, raw: RawRequest, timing: Timing) -> Work | None:
        ctx = self.ctx
        token = object()
        ctx.scheduler.decoding_started(token)
        t0 = time.perf_counter()
        try:
            return await ctx.cpu.run(route.decode, raw)
        except DryRunComplete:
            return None
        finally:
            ctx.scheduler.decoding_done(token)
            dt = time.perf_counter() - t0
            timing.add("decode", dt)
            ctx.metrics.stage.labels(route.path, "decode").observe(dt)

    @staticmethod
    def _dry_run_doc(raw: RawRequest, work: Work | None) -> dict[str, Any]:
        estimate = raw.cost.estimate
        items = len(work.items) if work is not None else (estimate.items if estimate is not None else 0)
        return {"valid": True, "items": items, "cost": None if estimate is None else estimate.as_dict()}

    @staticmethod
    def _respond(reply: Reply, timing: Timing, charge: Charge | None = None) -> Response:
        headers = {**reply.headers, "Server-Timing": timing.header()}
        return HeldResponse(reply.body, status_code=reply.status, media_type=reply.media_type, headers=headers,
                            charge=charge)


def is_dry_run(headers: dict[str, str]) -> bool:
    return headers.get(DRY_RUN_HEADER, "").strip().lower() in ("1", "true")


def reply_size(reply: Reply) -> int:
    return len(reply.body) if isinstance(reply.body, bytes) else sum(map(len, reply.body))


class HeldResponse(Response):
    """A response whose bytes stay charged to the memory ledger until they are sent (or the
    connection is gone): an answer a client does not read still counts. A body given as a
    list of parts is sent part after part."""

    def __init__(self, content: bytes | list[bytes], *args: Any, charge: Charge | None = None, **kwargs: Any):
        self._parts = None if isinstance(content, bytes) else content
        super().__init__(content if isinstance(content, bytes) else b"", *args, **kwargs)
        if self._parts is not None:
            self.headers["content-length"] = str(sum(map(len, self._parts)))
        self._charge = charge

    async def __call__(self, scope, receive, send) -> None:
        try:
            if self._parts is None:
                await super().__call__(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") != "HEAD":
                for n, part in enumerate(self._parts):
                    await send({"type": "http.response.body", "body": part, "more_body": n < len(self._parts) - 1})
            else:
                await send({"type": "http.response.body", "body": b""})
        finally:
            if self._charge is not None:
                self._charge.close()

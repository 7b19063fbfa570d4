"""The request pipeline every model route goes through.

    auth (middleware) -> read body (loop, limits, memory ledger) -> admit (queue slot or 503)
      -> decode hook (CPU pool) -> queue, batch, infer (GPU worker) -> encode hook (CPU pool)
      -> respond with Server-Timing

A route is a ``ModelRoute``: ``decode(raw) -> Work`` turns the raw request into model
items and a batching key (parse parameters, decode images); ``encode(work, results,
raw) -> Reply`` turns results into bytes. Both run in the CPU pool, never on the event
loop. Limits, admission, deadlines, disconnects, metrics and the dry run
(``X-Onecard-Dry-Run: 1``: everything up to the model, then ``{"valid": true}``) hold
for every route alike, webui routes included. Services write their routes with the
public API (``onecard.Model``, ``onecard.Route``), which builds these.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.runtime.codecs.forms import media_type
from services.runtime.codecs.gil_lane import release_here
from services.runtime.codecs.json_answer import json_parts
from services.runtime.edge.body import query_params, read_body
from services.runtime.errors import ApiError, error_responses
from services.runtime.pipeline.admission import Admission
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.budgets import MemoryWait
from services.runtime.pipeline.cost import DryRunComplete, RequestCost
from services.runtime.pipeline.cpu_pool import CpuPool, cpu_pool_size
from services.runtime.pipeline.held_response import HeldResponse
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.raw_request import RawRequest
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.pipeline.timing import Timing

DRY_RUN_HEADER = "x-onecard-dry-run"


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


def json_reply(doc: Any, headers: dict[str, str] | None = None) -> Reply:
    parts = json_parts(doc)
    return Reply(parts[0] if len(parts) == 1 else parts, "application/json", headers or {})


@dataclass
class ModelRoute:
    path: str
    decode: Callable[[RawRequest], Work | None]
    encode: Callable[[Work, list[Any], RawRequest], Reply]
    summary: str = ""
    description: str = ""
    request_body: dict[str, Any] | None = None       # OpenAPI requestBody
    responses: dict[int | str, Any] = field(default_factory=dict)
    parameters: list[dict[str, Any]] = field(default_factory=list)  # OpenAPI query parameters
    tags: list[str] = field(default_factory=list)
    error_body: Callable[[ApiError], dict] | None = None  # a route-specific error shape (webui)


class ModelPipeline:
    """One service's model side: admission, the CPU pool, the scheduler (made when the model
    has loaded) and the routes that feed it."""

    def __init__(self, settings: ModelServiceSettings, backend: Backend, metrics: PipelineMetrics, threads: int):
        self.settings = settings
        self.backend = backend
        self.metrics = metrics
        self.admission = Admission(settings.max_queue, settings.retry_after_s)
        self.cpu = CpuPool(settings.cpu_workers or cpu_pool_size(threads))
        self.scheduler: Scheduler | None = None
        self.routes: dict[str, ModelRoute] = {}
        self.ready = False
        self.draining = False

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
        timing = Timing()
        if not self.ready or self.scheduler is None:
            raise ApiError(503, "not_ready", "the model is still loading", {"Retry-After": "5"})
        scheduler = self.scheduler
        connection = request.scope.get("client")
        scheduler.request_arrived(connection)
        charge = scheduler.cost.new_charge()
        ticket = None
        try:
            # The body first (its bytes charged to the memory ledger as they arrive, waiting their
            # turn when others hold the room), the queue slot once it is all here: uploads still
            # arriving, slowly or on purpose, hold no slot of max_queue, and the slot is still
            # taken before anything is decoded.
            body = await read_body(request, self.settings.max_body_bytes,
                                   lambda n: self._hold_body(charge, n, timing), self.settings.max_json_items,
                                   self.settings.max_json_depth)
            ticket = self.admission.admit()
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
            ctype = headers.get("content-type", "")
            dry_run = is_dry_run(headers)
            raw = RawRequest(request.method, route.path, query_params(request), headers, media_type(ctype), ctype,
                             body)
            raw.cost = RequestCost(scheduler.cost, charge, len(body), dry_run=dry_run)
            work = await self._decode(route, raw, timing)
            if work is None:  # a dry run that the hook ended after its cost check
                reply = json_reply(self._dry_run_doc(raw, None))
                garbage = [raw, body]   # freed on a worker, as a served request's are
                del raw, body
                self.cpu.release(garbage)
                return self._respond(reply, timing, charge)
            if raw.cost.estimate is None:  # a hook that stated no cost: what its items say
                try:
                    await self.cpu.run(self._cost_of_items, raw, work)
                except MemoryWait as wait:  # others hold the room: its turn comes (or a 503)
                    await self._wait_turn(charge, wait, timing)
            if dry_run:
                return self._respond(json_reply(self._dry_run_doc(raw, work)), timing, charge)
            try:  # a request that brought no item has nothing to run
                results = await scheduler.submit(work.items, work.key, timing, request.receive, ticket) \
                    if work.items else []
            except asyncio.CancelledError:
                if not self.draining:
                    raise
                # the drain ran out of time: say so, retryably, instead of uvicorn's plain 500
                raise ApiError(503, "shutting_down", "the service stopped before this request finished; retry",
                               {"Retry-After": str(self.settings.retry_after_s), "Connection": "close"}) from None
            token = object()
            scheduler.answering(token)
            charge.on_close = lambda: scheduler.answered(token, connection)  # sent, or the client is gone
            self.metrics.stage.labels(route.path, "queue").observe(timing.stages.get("queue", 0.0))
            self.metrics.stage.labels(route.path, "infer").observe(timing.stages.get("infer", 0.0))
            t1 = time.perf_counter()
            try:
                reply = await self.cpu.run(route.encode, work, results, raw)
            finally:
                dt = time.perf_counter() - t1
                timing.add("encode", dt)
                self.metrics.stage.labels(route.path, "encode").observe(dt)
            garbage = [work, results, raw, body]
            del work, results, raw, body
            self.cpu.release(garbage)
            charge.account(reply_size(reply))  # only the answer is held now, until it is sent
        except BaseException:
            charge.close()
            raise
        finally:
            if ticket is not None:
                ticket.release()
        return self._respond(reply, timing, charge)

    async def _hold_body(self, charge, n: int, timing: Timing) -> None:
        """The body holds `n` bytes from now; when others hold the room it waits its turn
        (first come, first served, until the request's deadline) while the client's bytes wait
        in the socket."""
        try:
            charge.hold(n, "the body", wait=True)
        except MemoryWait as wait:
            await self._wait_turn(charge, wait, timing)

    async def _wait_turn(self, charge, wait: MemoryWait, timing: Timing) -> None:
        """Hold what `wait` asks for once it is this request's turn, within its deadline."""
        left = timing.t0 + self.settings.request_timeout_s - time.perf_counter()
        await self.scheduler.cost.held.wait_for(charge, wait.needed, wait.what, left)

    async def _decode(self, route: ModelRoute, raw: RawRequest, timing: Timing) -> Work | None:
        token = object()
        self.scheduler.decoding_started(token)
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    return await self.cpu.run(_decode_or_none, route.decode, raw)
                except MemoryWait as wait:  # others hold the room: wait its turn, then decode again
                    self.scheduler.decoding_waits(token, True)  # not coming before they run
                    try:
                        await self._wait_turn(raw.cost.charge, wait, timing)
                    finally:
                        self.scheduler.decoding_waits(token, False)
        finally:
            self.scheduler.decoding_done(token)
            dt = time.perf_counter() - t0
            timing.add("decode", dt)
            self.metrics.stage.labels(route.path, "decode").observe(dt)

    def _cost_of_items(self, raw: RawRequest, work: Work) -> None:
        raw.cost.check(items=len(work.items), item_pixels=[self.scheduler.cost.item_pixels(i) for i in work.items],
                       dry_run_stops_here=False)

    @staticmethod
    def _dry_run_doc(raw: RawRequest, work: Work | None) -> dict[str, Any]:
        estimate = raw.cost.estimate
        items = len(work.items) if work is not None else (estimate.items if estimate is not None else 0)
        return {"valid": True, "items": items, "cost": None if estimate is None else estimate.public()}

    @staticmethod
    def _respond(reply: Reply, timing: Timing, charge=None) -> Response:
        headers = {**reply.headers, "Server-Timing": timing.header()}
        return HeldResponse(reply.body, status_code=reply.status, media_type=reply.media_type, headers=headers,
                            charge=charge)


def is_dry_run(headers: dict[str, str]) -> bool:
    return headers.get(DRY_RUN_HEADER, "").strip().lower() in ("1", "true")


def is_dry_run_scope(scope: dict) -> bool:
    return any(k == b"x-onecard-dry-run" and v.strip().lower() in (b"1", b"true") for k, v in scope["headers"])


def reply_size(reply: Reply) -> int:
    return len(reply.body) if isinstance(reply.body, bytes) else sum(map(len, reply.body))


def _decode_or_none(decode: Callable[[RawRequest], Work | None], raw: RawRequest) -> Work | None:
    """The hook's work, or None where a dry run ended it after its cost check. The end is
    caught here, on the worker: the exception's frames hold what the hook had made of the
    body (a 20 MB string, its decoded bytes), and freed on the event loop they unmapped
    tens of megabytes with the GIL held at every dry run. Freed as they were, with the
    frames, they still did on the worker (5-7 ms a dry run, the loop waiting on the GIL):
    they are taken from the frames and freed as a served request's are, pages first."""
    try:
        return decode(raw)
    except DryRunComplete as end:
        try:
            made = frame_locals(end.__traceback__.tb_next)  # (not this frame's own: decode, raw)
        except Exception:  # noqa: BLE001 -- a hook's odd locals: freed as they are, the dry run answered
            return None
    # the exception and its frames are gone: what only `made` holds now is the hook's alone
    try:
        release_here(held_only_by(made))
    except Exception:  # noqa: BLE001 -- an optimisation, never the dry run's answer
        made.clear()
    return None


def frame_locals(tb: Any) -> list[Any]:
    """The local variables of a traceback's frames."""
    values: list[Any] = []
    while tb is not None:
        values.extend(tb.tb_frame.f_locals.values())
        tb = tb.tb_next
    return values


def held_only_by(values: list[Any]) -> list[Any]:
    """Those of `values` that nothing else holds (each once); `values` is emptied. What others
    hold stays out, so that the walk for big buffers (page_release) starts from the hook's
    own objects instead of spending its steps on the service's."""
    times = collections.Counter(map(id, values))
    kept: list[Any] = []
    seen: set[int] = set()
    for value in values:
        if id(value) not in seen:
            seen.add(id(value))
            if sys.getrefcount(value) == times[id(value)] + 2:  # + the loop's and the call's
                kept.append(value)
    values.clear()
    return kept

"""The jobs API: POST /v1/jobs, GET /v1/jobs/{id}, GET /v1/jobs/{id}/result, DELETE /v1/jobs/{id}
(listing and dead-letter redrive: api_admin.py)."""

from __future__ import annotations

import asyncio
import math
import re
import time
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from services.jobs.admission import ArrivingBody
from services.jobs.broker import IdempotencyMismatch, JobTooLarge, QueueFull, QueueUnavailable
from services.jobs.queue_room import ClientGone
from services.jobs.records import (
    CANCELLED,
    FAILED,
    SUCCEEDED,
    TERMINAL,
    NewJob,
    header_value,
    new_id,
    public_view,
    request_digest,
    stored_int,
    stored_object,
    valid_id,
)
from services.jobs.results import StreamedBody, first_piece, inline_parts
from services.jobs.service import JobsService
from services.jobs.tracing import described, submit_span, submitted
from services.runtime.edge.body import (
    body_begun,
    declared_length,
    read_body,  # 413 as soon as the size is known; a client gone mid-upload: ClientGone
)
from services.runtime.errors import ApiError
from services.runtime.errors import ClientGone as ClientLeft

IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")  # fullmatch: no trailing newline
SECONDS_RE = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")   # ASCII digits only: float() takes any script's
NO_BODY_STATUSES = (204, 205, 304)  # answers that carry no body (RFC 9110)

SUBMIT_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["service", "route"], "additionalProperties": False, "properties": {
        "service": {"type": "string", "description": "the service name, e.g. img2img or detect"},
        "route": {"type": "string", "description": "a public POST route of that service, e.g. /api/v1/img2img"},
        "model": {"type": "string", "description": "model label service/backend/model; default: the only one"},
        "params": {"type": "object", "description": "the route's JSON fields, except the image"},
        "image": {"type": "string", "description": "base64"},
        "body": {"type": "object", "description": "the route's own JSON body, instead of params and image"},
        "priority": {"type": "string", "enum": ["high", "normal", "low"], "default": "normal",
                     "description": "higher levels of a model run first; FIFO within a level"}}}}}}
JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}}


def unavailable(svc: JobsService, exc: Exception) -> ApiError:
    # Redis's own text names hosts, scripts and keys: a client hears only the kind of failure
    cause = exc.__cause__
    why = type(cause).__name__ if isinstance(cause, (RedisError, OSError)) else str(exc)
    return ApiError(503, "queue_unavailable", f"the job queue cannot be reached now ({why}); retry later",
                    {"Retry-After": str(svc.settings.retry_after_s)})


def not_found(svc: JobsService, job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"no job {job_id} (unknown, or expired after "
                    f"{svc.settings.queue.results_ttl_s:g} s)")


def add_routes(app: FastAPI, svc: JobsService) -> None:
    settings = svc.settings

    async def fields_of(job_id: str) -> dict[str, str]:
        if not valid_id(job_id):
            raise ApiError(404, "job_not_found", "no such job (ids are 32 hex digits)")
        try:
            fields = await svc.broker.get(job_id)
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        if fields is None:
            raise not_found(svc, job_id)
        return fields

    @app.post("/v1/jobs", status_code=202, summary="Submit a job", openapi_extra={"requestBody": SUBMIT_BODY,
              "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                              "schema": {"type": "string", "maxLength": 255}}]})
    async def submit(request: Request) -> Any:
        if not svc.ready:
            raise ApiError(503, "not_ready", svc.startup_problem or "starting", {"Retry-After": "1"})
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(415, "unsupported_media_type", "send the job as application/json")
        idem = request.headers.get("idempotency-key")
        if idem is not None and not IDEMPOTENCY_KEY_RE.fullmatch(idem):
            raise ApiError(400, "bad_idempotency_key", "Idempotency-Key: 1 to 255 visible ASCII characters")
        # admitted against the memory bound once its body has begun, before the rest is read: a
        # client that asked for 100 Continue and sent nothing (200 of them, reconnecting) held the
        # whole bound, 5 s each, while legitimate submits waited behind them for 27 s (helper-58)
        declared = declared_length(request, settings.max_body_bytes)  # over the limit: 413 before any is read
        arrived = await body_begun(request)
        began = asyncio.get_running_loop().time()
        with await svc.submits.take(svc.submits.cost(declared, settings.max_body_bytes)):
            if not arrived[-1].get("more_body", False) and await request.is_disconnected():
                # its whole body came before it waited in line: a client that left meanwhile would
                # otherwise get a job made for nobody (with more to read, the read sees it leave)
                raise ClientLeft()
            arriving = ArrivingBody(request.receive, svc.submits, arrived, last=began)
            return await _submit(Request(request.scope, arriving), idem)

    async def _submit(request: Request, idem: str | None) -> Any:
        if svc.traces is None:
            return await _accept(request, idem, None)
        with submit_span(svc.traces) as span:  # the dry run and the queueing, under the request's span
            return await _accept(request, idem, span)

    async def _accept(request: Request, idem: str | None, span: Any) -> Any:
        # the JSON's items counted as it arrives, as every service's bodies: a 30 MB document of
        # `[]` is refused at its first 10 000 items, not read whole and parsed in the helper
        raw = await read_body(request, settings.max_body_bytes, max_json_items=settings.max_json_items,
                              max_json_depth=settings.max_json_depth)
        req = await svc.digest(raw)
        garbage = [raw]
        del raw
        svc.release(garbage)  # its pages go back on a worker thread, not on the loop
        if not req.parsed:
            req.raise_error()
        try:
            label, limits, target = await svc.resolve(req)  # an unknown service or model is said first
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        req.raise_error()
        req.check(limits)  # the model's own limits, tighter than the unit's
        body, sha = req.body, req.sha
        reserve = settings.result_reserve_bytes
        trace = None
        if span is not None:
            described(span, req.service, req.route, label, req.priority)
            trace = svc.traces.carrier_of(span)  # kept with the job: its runs continue this trace
        if target is not None:
            verdict = await target.dry_run(req.route, body, trace)
            if verdict.error is not None:
                raise verdict.error
            if verdict.output_bytes is not None:
                reserve = verdict.output_bytes
        job = NewJob(new_id(), req.service, req.route, label, body, request_digest(req.service, req.route, label, sha),
                     idem, time.time(), req.priority, min(reserve, settings.max_result_bytes), trace)
        try:
            sub = await svc.room.submit(lambda: svc.broker.submit(job, label), request.is_disconnected)
        except JobTooLarge as exc:
            raise ApiError(413, "job_too_large", str(exc)) from None
        except QueueFull as exc:
            raise ApiError(503, "queue_full", str(exc), {"Retry-After": str(settings.retry_after_s)}) from None
        except ClientGone as exc:  # no one reads this answer
            raise ApiError(400, "client_gone", str(exc), {"Connection": "close"}) from None
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        except IdempotencyMismatch as exc:
            raise ApiError(422, "idempotency_key_reused", f"this Idempotency-Key was used for job {exc}, another "
                           "request (service, route, model or body differ)") from None
        if sub.created:
            svc.metrics.count("submitted")
        if span is not None:
            submitted(span, sub.id, sub.created)
        headers = {"Location": f"/v1/jobs/{sub.id}"}
        if not sub.created:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse({"id": sub.id, "state": sub.state, "model": sub.model or label}, status_code=202,
                            headers=headers)

    async def stream_slot() -> Any:
        return (await svc.stream_slots.take(1)).release

    @app.get("/v1/jobs/{job_id}", summary="A job's state (and its result once it has one)",
             openapi_extra={"parameters": [{"name": "result", "in": "query", "required": False,
                                            "schema": {"type": "boolean"}},
                                           {"name": "wait", "in": "query", "required": False,
                                            "schema": {"type": "number", "minimum": 0},
                                            "description": "long poll: answer once the job is finished, or "
                                            "after this many seconds (at most max_wait_s)"}]})
    async def get_job(job_id: str, request: Request) -> Any:
        want = request.query_params.get("result", "true").lower() not in ("0", "false", "no")
        wait_s = 0.0
        if (wait := request.query_params.get("wait")) is not None:
            if not SECONDS_RE.fullmatch(wait) or not math.isfinite(float(wait)):
                raise ApiError(422, "invalid_parameter", "wait: expected seconds, such as 10 or 2.5")
            wait_s = min(float(wait), settings.max_wait_s)
        if not valid_id(job_id):
            raise ApiError(404, "job_not_found", "no such job (ids are 32 hex digits)")
        read = partial(svc.broker.result_chunk, job_id)
        first = None
        try:
            fields = await svc.job(job_id, wait_s)
            size = await svc.broker.result_size(job_id) if want and fields and fields.get("state") == SUCCEEDED \
                else None
            if size is not None and (first := await first_piece(read, size)) is None:
                size, fields = None, await svc.job(job_id, 0)  # it expired just now: the record may have too
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        if fields is None:
            raise not_found(svc, job_id)
        head, tail, encode = inline_parts(public_view(fields), fields, size)
        if size is None or first is None:
            return Response(head, media_type="application/json")
        return StreamedBody(head, tail, size, first, read, encode, "application/json", svc.cpu,
                            settings.result_send_timeout_s, slot=stream_slot, live=svc.live_streams)

    @app.get("/v1/jobs/{job_id}/result", summary="The service's answer: its bytes and content type",
             responses={200: {"content": {"application/json": {}, "image/png": {}, "image/jpeg": {},
                                          "image/webp": {}}}})
    async def get_result(job_id: str) -> Any:
        fields = await fields_of(job_id)
        state = fields.get("state")
        if state not in TERMINAL:
            raise ApiError(409, "job_not_finished", f"job {job_id} is {state}",
                           {"Retry-After": str(settings.retry_after_s)})
        if state == CANCELLED:
            raise ApiError(409, "job_cancelled", f"job {job_id} was cancelled")
        read = partial(svc.broker.result_chunk, job_id)
        try:
            size = await svc.broker.result_size(job_id)
            first = await first_piece(read, size) if size is not None else None
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        status = stored_int(fields.get("result_status"))
        # a stored 700 ended the answer without a byte; a 204, 205 or 304 carries no body, and the
        # stored bytes after it would be read as the start of the client's next answer
        status = status if 200 <= status <= 599 and status not in NO_BODY_STATUSES else 0
        if size is None or first is None or (state == FAILED and status < 400):
            err = public_view(fields)["error"]
            err = err if isinstance(err, dict) else {}
            raise ApiError(409 if state == FAILED else 410, "job_failed" if state == FAILED else "result_expired",
                           f"job {job_id}: {err.get('message', 'no result')}")
        seed = header_value(stored_object(fields.get("result_headers")).get("x-seed"))
        return StreamedBody(b"", b"", size, first, read, False,
                            header_value(fields.get("result_type")) or "application/octet-stream", svc.cpu,
                            settings.result_send_timeout_s, {"x-seed": seed} if seed else {},
                            status or 200, slot=stream_slot, live=svc.live_streams)

    @app.delete("/v1/jobs/{job_id}", summary="Cancel a job")
    async def cancel(job_id: str) -> Any:
        if not valid_id(job_id):
            raise ApiError(404, "job_not_found", "no such job (ids are 32 hex digits)")
        try:
            found = await svc.broker.cancel(job_id)
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        if found is None:
            raise ApiError(404, "job_not_found", f"no job {job_id}")
        verdict, fields = found
        if verdict in (SUCCEEDED, FAILED):
            raise ApiError(409, "job_finished", f"job {job_id} has already {verdict}")
        # running: accepted, the unit running it stops it between steps; poll for 'cancelled'
        return JSONResponse(public_view(fields), status_code=202 if verdict == "cancelling" else 200)

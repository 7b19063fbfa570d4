"""The jobs API: POST /v1/jobs, GET /v1/jobs/{id}, GET /v1/jobs/{id}/result, DELETE /v1/jobs/{id}."""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from redis.exceptions import RedisError
from fastapi.responses import JSONResponse, Response

from services.jobs.broker import IdempotencyMismatch, QueueFull, QueueUnavailable
from services.jobs.payload import build_body, parse_envelope
from services.jobs.records import (CANCELLED, FAILED, SUCCEEDED, TERMINAL, NewJob, new_id, public_view, render_result,
                                   request_digest, valid_id)
from services.jobs.service import JobsService
from services.runtime.body import read_body  # 413 as soon as the size is known; a client gone mid-upload: ClientGone
from services.runtime.errors import ApiError

IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")  # fullmatch: no trailing newline
SECONDS_RE = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")   # ASCII digits only: float() takes any script's

SUBMIT_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["service", "route"], "additionalProperties": False, "properties": {
        "service": {"type": "string", "description": "the service name, e.g. img2img or detect"},
        "route": {"type": "string", "description": "a public POST route of that service, e.g. /api/v1/img2img"},
        "model": {"type": "string", "description": "model label service/backend/model; default: the only one"},
        "params": {"type": "object", "description": "the route's JSON fields, except the image"},
        "image": {"type": "string", "description": "base64"},
        "body": {"type": "object", "description": "the route's own JSON body, instead of params and image"}}}}}}
JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}}


def _unavailable(svc: JobsService, exc: Exception) -> ApiError:
    # Redis's own text names hosts, scripts and keys: a client hears only the kind of failure
    cause = exc.__cause__
    why = type(cause).__name__ if isinstance(cause, (RedisError, OSError)) else str(exc)
    return ApiError(503, "queue_unavailable", f"the job queue cannot be reached now ({why}); retry later",
                    {"Retry-After": str(svc.settings.retry_after_s)})


def add_routes(app: FastAPI, svc: JobsService) -> None:
    settings = svc.settings

    async def fields_of(job_id: str) -> dict[str, str]:
        if not valid_id(job_id):
            raise ApiError(404, "job_not_found", "no such job (ids are 32 hex digits)")
        try:
            fields = await svc.broker.get(job_id)
        except QueueUnavailable as exc:
            raise _unavailable(svc, exc) from None
        if fields is None:
            raise ApiError(404, "job_not_found", f"no job {job_id} (unknown, or expired after "
                           f"{settings.queue.results_ttl_s:g} s)")
        return fields

    def location(job_id: str) -> str:
        return f"/v1/jobs/{job_id}"

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
        raw = await read_body(request, settings.max_body_bytes)
        req = await svc.cpu(len(raw), parse_envelope, raw, settings.max_json_depth)
        try:
            label, limits, target = await svc.resolve(req)
        except QueueUnavailable as exc:
            raise _unavailable(svc, exc) from None
        body, sha = await svc.cpu(len(raw), build_body, req, limits)
        if target is not None:
            rejected = await target.dry_run(req.route, body)
            if rejected is not None:
                raise rejected
        job = NewJob(new_id(), req.service, req.route, label, body, request_digest(req.service, req.route, label, sha),
                     idem, time.time())
        try:
            sub = await svc.broker.submit(job, label)
        except QueueFull as exc:
            raise ApiError(503, "queue_full", str(exc), {"Retry-After": str(settings.retry_after_s)}) from None
        except QueueUnavailable as exc:
            raise _unavailable(svc, exc) from None
        except IdempotencyMismatch as exc:
            raise ApiError(422, "idempotency_key_reused", f"this Idempotency-Key was used for job {exc}, another "
                           "request (service, route, model or body differ)") from None
        if sub.created:
            svc.metrics.count("submitted")
        headers = {"Location": location(sub.id)}
        if not sub.created:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse({"id": sub.id, "state": sub.state, "model": label}, status_code=202, headers=headers)

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
        try:
            found = await svc.job(job_id, wait_s, want)
        except QueueUnavailable as exc:
            raise _unavailable(svc, exc) from None
        if found is None:
            raise ApiError(404, "job_not_found", f"no job {job_id} (unknown, or expired after "
                           f"{settings.queue.results_ttl_s:g} s)")
        fields, data = found
        view = public_view(fields)
        view["result"] = None
        if view["state"] == SUCCEEDED and data is not None:
            headers = json.loads(fields.get("result_headers") or "{}")
            view["result"] = await svc.cpu(len(data), render_result, data, fields.get("result_type", ""), headers)
        body = await svc.cpu(len(data or b""), json.dumps, view)
        return Response(body, media_type="application/json")

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
        try:
            data = await svc.broker.result(job_id)
        except QueueUnavailable as exc:
            raise _unavailable(svc, exc) from None
        status = int(fields.get("result_status") or 0)
        if data is None or (state == FAILED and status < 400):
            err = public_view(fields)["error"] or {}
            raise ApiError(409 if state == FAILED else 410, "job_failed" if state == FAILED else "result_expired",
                           f"job {job_id}: {err.get('message', 'no result')}")
        headers = json.loads(fields.get("result_headers") or "{}")
        return Response(data, status_code=status or 200, media_type=fields.get("result_type") or None,
                        headers={k: v for k, v in headers.items() if k == "x-seed"})

    @app.delete("/v1/jobs/{job_id}", summary="Cancel a job")
    async def cancel(job_id: str) -> Any:
        if not valid_id(job_id):
            raise ApiError(404, "job_not_found", "no such job (ids are 32 hex digits)")
        try:
            found = await svc.broker.cancel(job_id)
        except QueueUnavailable as exc:
            raise _unavailable(svc, exc) from None
        if found is None:
            raise ApiError(404, "job_not_found", f"no job {job_id}")
        verdict, fields = found
        if verdict in (SUCCEEDED, FAILED):
            raise ApiError(409, "job_finished", f"job {job_id} has already {verdict}")
        # running: accepted, the unit running it stops it between steps; poll for 'cancelled'
        return JSONResponse(public_view(fields), status_code=202 if verdict == "cancelling" else 200)


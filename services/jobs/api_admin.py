"""The jobs API for operators: a bounded, paginated listing of a model's jobs by state
(GET /v1/jobs), and the redrive of dead-lettered jobs, one (POST /v1/jobs/{id}/redrive) or a
model's (POST /v1/jobs/redrive)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.jobs.api import unavailable
from services.jobs.broker import QueueUnavailable
from services.jobs.records import DEAD, LIST_STATES, public_view, valid_id
from services.jobs.service import JobsService
from services.jobs.settings import LABEL_RE
from services.jobs.views import EncodedViews
from services.runtime.codecs.forms import parse_json
from services.runtime.edge.body import read_body
from services.runtime.errors import ApiError

CURSOR_RE = re.compile(r"[0-9a-f:-]{1,80}")
ALL_STATES = tuple(s for s in LIST_STATES if s != DEAD)  # dead-lettered jobs are failed ones too
DEFAULT_LIMIT = 50
REDRIVE_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["model"], "additionalProperties": False, "properties": {
        "model": {"type": "string", "description": "the model label whose dead-lettered jobs go back on its queue"},
        "limit": {"type": "integer", "minimum": 1, "description": "at most this many (default and most: "
                  "max_list_limit)"}}}}}}


def _model(value: Any) -> str:
    if not isinstance(value, str) or not LABEL_RE.fullmatch(value):
        raise ApiError(422, "invalid_parameter", "model: expected a model label service/backend/model")
    return value


def _limit(value: Any, most: int, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, str):
        digits = value.lstrip("0")  # int() of 4 301 digits raises, zeros or not
        if not value.isascii() or not value.isdigit() or len(digits) > 9:
            raise ApiError(422, "invalid_parameter", f"limit: expected a whole number from 1 to {most}")
        value = int(digits or "0")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ApiError(422, "invalid_parameter", f"limit: expected a whole number from 1 to {most}")
    return value


REDRIVE_ERRORS = {
    "missing": (404, "job_not_found", "no job {id}"),
    "not_dead": (409, "job_not_dead_lettered", "job {id} is not a dead-lettered job"),
    "no_body": (410, "body_expired", "job {id}: its body is gone; it cannot run again"),
    "nomem": (503, "queue_full", "the queue has no room to take job {id} back now; retry later"),
}


LISTED_JOB_BYTES = 1024  # about what one job's view takes in a listing's JSON


def add_admin_routes(app: FastAPI, svc: JobsService) -> None:
    settings = svc.settings
    views = EncodedViews(settings.listed_views_bytes)
    listing_slots = asyncio.Semaphore(settings.max_listings_at_once)

    @app.get("/v1/jobs", summary="A model's jobs in one state, oldest first, a page at a time",
             openapi_extra={"parameters": [
                 {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}},
                 {"name": "state", "in": "query", "required": False,
                  "schema": {"type": "string", "enum": list(LIST_STATES)},
                  "description": "without it: every state, in this order (dead-lettered jobs among the failed)"},
                 {"name": "limit", "in": "query", "required": False,
                  "schema": {"type": "integer", "minimum": 1, "maximum": settings.max_list_limit}},
                 {"name": "cursor", "in": "query", "required": False, "schema": {"type": "string"},
                  "description": "next_cursor of the previous page"}]})
    async def list_jobs(request: Request) -> Any:
        q = request.query_params
        model = _model(q.get("model"))
        state = q.get("state")
        if state is not None and state not in LIST_STATES:
            raise ApiError(422, "invalid_parameter", f"state: expected one of {', '.join(LIST_STATES)}")
        limit = _limit(q.get("limit"), settings.max_list_limit, min(DEFAULT_LIMIT, settings.max_list_limit))
        cursor = q.get("cursor") or None
        if cursor is not None and not CURSOR_RE.fullmatch(cursor):
            raise ApiError(422, "invalid_parameter", "cursor: not a cursor this API gave")
        async with listing_slots:
            try:
                if state is not None:
                    jobs, nxt = await svc.broker.list_jobs(model, state, limit, cursor)
                else:
                    jobs, nxt = await every_state(model, limit, cursor)
            except ValueError:
                raise ApiError(422, "invalid_parameter", "cursor: not a cursor this API gave") from None
            except QueueUnavailable as exc:
                raise unavailable(svc, exc) from None
            # a page of 500 is 200 kB of JSON: made on the loop, 16 clients listing kept /healthz
            # waiting 126 ms at p99; off the loop when it is big, finished jobs' views kept encoded.
            # Two at a time: 16 at once (each a copy of 500 jobs on the loop, and a page on a
            # worker) kept the loop busy 97 % of the time and /healthz at 32 ms p99; 11 ms with two
            page = await svc.cpu(len(jobs) * LISTED_JOB_BYTES, views.page, model, state, jobs, nxt)
        return Response(page, media_type="application/json")

    async def every_state(model: str, limit: int, cursor: str | None) -> tuple[list[dict[str, str]], str | None]:
        """Without a state: each state in turn (queued, running, succeeded, failed, cancelled);
        the cursor is the state's number, then that state's own cursor."""
        i, sub = 0, None
        if cursor is not None:
            head, _, rest = cursor.partition(":")
            if not head.isdigit() or int(head) >= len(ALL_STATES):
                raise ValueError(cursor)
            i, sub = int(head), rest or None
        jobs: list[dict[str, str]] = []
        while i < len(ALL_STATES) and len(jobs) < limit:
            page, sub = await svc.broker.list_jobs(model, ALL_STATES[i], limit - len(jobs), sub)
            jobs += page
            if sub is None:
                i += 1
        return jobs, (f"{i}:{sub or ''}" if i < len(ALL_STATES) else None)

    async def redrive_one(job_id: str) -> str:
        try:
            verdict = await svc.broker.redrive(job_id)
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        if verdict == "ok":
            svc.metrics.count("redriven")
        return verdict

    @app.post("/v1/jobs/{job_id}/redrive", summary="Put one dead-lettered job back on its queue (attempts reset)")
    async def redrive(job_id: str) -> Any:
        if not valid_id(job_id):
            raise ApiError(404, "job_not_found", "no such job (ids are 32 hex digits)")
        verdict = await redrive_one(job_id)
        if verdict != "ok":
            status, code, message = REDRIVE_ERRORS.get(verdict, (409, verdict, "job {id}: " + verdict))
            headers = {"Retry-After": str(settings.retry_after_s or 1)} if status == 503 else None
            raise ApiError(status, code, message.format(id=job_id), headers)
        try:
            fields = await svc.broker.get(job_id)
        except QueueUnavailable as exc:
            raise unavailable(svc, exc) from None
        return JSONResponse(public_view(fields or {"id": job_id, "state": "queued"}))

    @app.post("/v1/jobs/redrive", summary="Put a model's dead-lettered jobs back on its queue, oldest first",
              openapi_extra={"requestBody": REDRIVE_BODY})
    async def redrive_model(request: Request) -> Any:
        raw = await read_body(request, 4096)
        doc = parse_json(raw or b"{}", 4)
        if not isinstance(doc, dict) or set(doc) - {"model", "limit"}:
            raise ApiError(422, "invalid_parameter", "body: expected {\"model\": ..., \"limit\": ...}")
        model = _model(doc.get("model"))
        limit = _limit(doc.get("limit"), settings.max_list_limit, settings.max_list_limit)
        redriven: list[str] = []
        skipped: list[dict[str, str]] = []
        cursor, full = None, False
        while len(redriven) + len(skipped) < limit and not full:
            try:
                page, cursor = await svc.broker.list_jobs(model, DEAD, min(100, limit - len(redriven) - len(skipped)),
                                                          cursor)
            except QueueUnavailable as exc:
                raise unavailable(svc, exc) from None
            for fields in page:
                verdict = await redrive_one(fields["id"])
                if verdict == "ok":
                    redriven.append(fields["id"])
                elif verdict == "nomem":
                    full = True
                    break
                else:
                    skipped.append({"id": fields["id"], "reason": verdict})
            if cursor is None:
                break
        return {"model": model, "redriven": redriven, "skipped": skipped,
                "more": full or cursor is not None, "queue_full": full}

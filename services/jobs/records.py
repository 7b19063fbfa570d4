"""A job as both backends store it (flat string fields), and its public view."""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
DEAD = "dead"  # not a state of its own: failed jobs that were dead-lettered (listed and redriven apart)
LIST_STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, DEAD)
# priority levels, highest first; FIFO within a level
LEVELS = ("high", "normal", "low")
NORMAL = "normal"
ID_RE = re.compile(r"[0-9a-f]{32}")  # with fullmatch: "$" would let a trailing newline through
# headers of a service's answer worth keeping with its result
KEPT_HEADERS = ("x-seed", "server-timing")


def new_id() -> str:
    return uuid.uuid4().hex


def valid_id(job_id: str) -> bool:
    return ID_RE.fullmatch(job_id) is not None


def request_digest(service: str, route: str, model: str, body_sha: str) -> str:
    """What makes two submits the same job, for an Idempotency-Key: the service, the route, the
    model label and the body sent to the service (a reused key with any of them changed is 422)."""
    return hashlib.sha256(json.dumps([service, route, model, body_sha]).encode()).hexdigest()


@dataclass
class NewJob:
    """A validated submit, ready to be queued."""
    id: str
    service: str
    route: str
    model: str
    body: bytes                    # the JSON body sent to the service
    request_sha: str               # request_digest(): compared when an Idempotency-Key is reused
    idempotency_key: str | None
    created_at: float
    priority: str = NORMAL
    reserve: int = 0               # bytes kept for the result from submit to finish
    trace: dict[str, str] | None = None  # the submit's traceparent (and tracestate): record fields of their own


@dataclass
class Delivery:
    """One run of one job handed to a consumer."""
    job_id: str
    label: str
    route: str
    body: bytes
    attempt: int                   # this run's number among the charged ones: charged attempts so far + 1
    entry: str | None = None       # the stream entry (Redis)
    queued_at: float | None = None
    started_at: float | None = None
    lease: str = ""                # every write of this run must show it (fencing)
    level: str = NORMAL            # the priority level, whose stream the entry is on
    isolate: bool = False          # run it alone: it was in flight when its service (or unit) crashed
    runs: int = 1                  # runs started, charged or not
    trace: dict[str, str] | None = None  # the submit's trace context, None when the record has none

    @property
    def charged(self) -> int:
        return self.attempt - 1


def trace_carrier(traceparent: str, tracestate: str = "") -> dict[str, str] | None:
    """A record's trace fields as a W3C carrier; None for a record written without them (by a
    unit without traces, or by an older version)."""
    if not traceparent:
        return None
    return {"traceparent": traceparent, "tracestate": tracestate} if tracestate else {"traceparent": traceparent}


@dataclass
class Submitted:
    id: str
    state: str
    created: bool          # False: an Idempotency-Key replay of an earlier submit
    model: str = ""


@dataclass
class Outcome:
    """How a run ended, as the consumer writes it back."""
    state: str                     # succeeded | failed | cancelled
    result: bytes | None = None
    content_type: str | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    dead_letter: bool = False
    result_json: bool = False      # the result is a JSON document (served inline as is, never parsed again)


def error_doc(code: str, message: str, status: int | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"code": code, "message": message}
    if status is not None:
        doc["status"] = status
    return doc


def _float(v: str | None) -> float | None:
    try:
        f = None if v in (None, "") else float(v)
    except ValueError:
        return None
    return f if f is None or math.isfinite(f) else None  # JSON has no NaN: a page of it was a 500


def stored_int(v: str | None) -> int:
    """A whole number the store holds, 0 if it holds anything else (a record edited by hand,
    another version's): one such field made every page showing the job a 500."""
    try:
        return int(v or 0)
    except ValueError:
        return 0


def stored_object(v: str | None) -> dict[str, Any]:
    """A JSON object the store holds, {} if it holds anything else."""
    value = _json(v)
    return value if isinstance(value, dict) else {}


# what uvicorn refuses in a header value once the answer has started (it then closes the
# connection without a byte): control characters other than a tab
HEADER_VALUE_BAD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def header_value(v: Any) -> str | None:
    """A stored text fit for an HTTP header (latin-1, no control character but a tab), else None."""
    if not isinstance(v, str) or HEADER_VALUE_BAD.search(v):
        return None
    try:
        v.encode("latin-1")
    except UnicodeEncodeError:
        return None
    return v


def _text(v: str | None) -> str | None:
    return v if v is None else _json_safe(v)


def _json(v: str | None) -> Any:
    if not v:
        return None
    try:
        return _json_safe(json.loads(v))
    except (ValueError, RecursionError):
        return None


def _json_safe(value: Any) -> Any:
    """A stored document as JSON can carry it: a non-finite number (json.loads reads NaN) as
    null, a lone surrogate (read from a \\ud800 escape) as U+FFFD. Either made every page that
    showed it a 500."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {_json_safe(k): _json_safe(v) for k, v in value.items()}
    return value


def public_view(fields: dict[str, str]) -> dict[str, Any]:
    """The job as GET /v1/jobs/{id} shows it, without the result."""
    state = fields.get("state", QUEUED)
    progress = 1.0 if state in TERMINAL else (_float(fields.get("progress")) or 0.0)
    return {
        "id": _text(fields.get("id")),
        "state": _text(state),
        "service": _text(fields.get("service")),
        "route": _text(fields.get("route")),
        "model": _text(fields.get("model")),
        "priority": _text(fields.get("priority")) or NORMAL,
        "attempts": stored_int(fields.get("attempts")),
        "runs": stored_int(fields.get("runs")),
        "progress": progress,
        "node": _text(fields.get("node")) or None,
        "error": _json(fields.get("error")) if state != SUCCEEDED else None,
        "last_error": _json(fields.get("last_error")) if state not in TERMINAL else None,
        "dead_lettered": fields.get("dead") == "1",
        "cancel_requested": fields.get("cancel") == "1",
        "created_at": _float(fields.get("created_at")),
        "started_at": _float(fields.get("started_at")),
        "finished_at": _float(fields.get("finished_at")),
        "retry_at": _float(fields.get("retry_at")) if state == QUEUED else None,
    }

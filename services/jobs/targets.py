"""The unit's own services that jobs run on ("targets"): where they are, which model each
has loaded (its label), which POST routes it serves, and how to call it.

Where: ``ONECARD_UNIT_SERVICES`` (JSON ``{"name": {"url": ...}}``, set by the supervisor),
else the ``targets`` table of the jobs settings. The label comes from the service's
``/info`` ``model_label``, else ``service/backend/<basename of model>``; a ``model_label``
in the jobs settings wins.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.jobs.broker import ModelInfo, numeric_limits
from services.jobs.settings import LABEL_RE, JobsSettings, TargetSettings, valid_route
from services.runtime.errors import ApiError

log = logging.getLogger("onecard.jobs")
DRY_RUN_HEADER = "X-Onecard-Dry-Run"
JOB_HEADER = "X-Onecard-Job"
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0
MAX_ERROR_BYTES = 64 * 1024
# A body this big is sent a piece at a time, each piece a view of it: handed over whole, the
# event loop's transport copied what the socket did not take at once (15-20 MB, twice, GIL
# held: 5-10 ms a job), and the probes of the jobs service waited behind each copy.
STREAMED_BODY_BYTES = 1 << 20
BODY_PIECE_BYTES = 256 * 1024


def unit_services(settings: JobsSettings, own_name: str, environ=os.environ) -> dict[str, TargetSettings]:
    """Every local service jobs may run on, with its URL and the settings' per-target overrides."""
    raw = environ.get("ONECARD_UNIT_SERVICES")
    out: dict[str, TargetSettings] = {}
    if raw:
        try:
            doc = json.loads(raw)
        except ValueError:
            raise ValueError("ONECARD_UNIT_SERVICES is not valid JSON") from None
        if not isinstance(doc, dict):
            raise ValueError("ONECARD_UNIT_SERVICES: expected a JSON object of services")
        for name, entry in doc.items():
            url = entry.get("url") if isinstance(entry, dict) else entry
            if name == own_name or not isinstance(url, str):
                continue
            out[name] = settings.target(name).model_copy(update={"url": url.rstrip("/")})
        return out
    for name in settings.targets:
        t = settings.target(name)
        if name != own_name and t.url:
            out[name] = t.model_copy(update={"url": t.url.rstrip("/")})
    return out


def _clean(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", part) or "default"


def model_label(name: str, info: dict[str, Any], override: str | None = None) -> str:
    if override:
        return override
    reported = info.get("model_label")
    if isinstance(reported, str) and LABEL_RE.fullmatch(reported):
        return reported
    model = info.get("model")
    base = os.path.basename(str(model).rstrip("/")) if model else ""
    return f"{_clean(name)}/{_clean(str(info.get('backend') or 'default'))}/{_clean(base or 'default')}"


def _takes_json(op: Any) -> bool:
    body = op.get("requestBody") if isinstance(op, dict) else None
    content = body.get("content") if isinstance(body, dict) else None
    return isinstance(content, dict) and "application/json" in content


def job_routes(openapi: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(job routes, control routes) of a service's OpenAPI document. A job is work on a JSON
    body: a POST route that declares one. A POST route without (/sdapi/v1/interrupt, /skip,
    /options, which reads its body itself) acts on the service, not on a job's input: queued,
    it would interrupt or reconfigure what other clients run, and its dry run would act."""
    jobs, control = [], []
    paths = openapi.get("paths") if isinstance(openapi, dict) else None
    for path, ops in (paths if isinstance(paths, dict) else {}).items():
        if isinstance(path, str) and valid_route(path) and isinstance(ops, dict) and "post" in ops:
            (jobs if _takes_json(ops["post"]) else control).append(path)
    return sorted(jobs), sorted(control)


class TargetUnreachable(Exception):
    """No answer from the local service: connection refused or reset."""


class TargetNotSent(TargetUnreachable):
    """The request never reached the service (connection refused: it is down or restarting)."""


class TargetCrashed(TargetUnreachable):
    """The service went away while it had the request (reset, closed without an answer)."""


class TargetTimeout(Exception):
    """The local service did not answer in time."""


def why(exc: aiohttp.ClientError) -> str:
    """What went wrong with a call to the service, fit for a job's public error and the log:
    the kind of failure and its reason, never the request. aiohttp's own text of a
    ClientResponseError carries the request's headers (the service's API key among them)
    and its internal address; a job's error is readable by anyone who can read the job."""
    kind = type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"{kind}: {exc.os_error.strerror or type(exc.os_error).__name__}"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{kind}: {exc.status} {str(exc.message)[:200]}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{kind}: the service closed the connection without an answer"
    return kind


class ResultTooLarge(Exception):
    """The local service's answer is over max_result_bytes."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]          # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        """The service's error envelope as a job error (status included). An envelope is
        small: a big body is not parsed (on the event loop) to find one."""
        try:
            if len(self.body) > MAX_ERROR_BYTES:
                raise ValueError("not an error envelope")
            err = self.json()["error"]
            return {"code": str(err["code"])[:200], "message": str(err["message"])[:2000], "status": self.status}
        except (ValueError, KeyError, TypeError, RecursionError):
            text = self.body[:500].decode(errors="replace")
            return {"code": "service_error", "message": text or f"HTTP {self.status}", "status": self.status}


@dataclass
class Target:
    name: str
    url: str
    settings: TargetSettings
    run_timeout_s: float
    dry_run_timeout_s: float
    max_result_bytes: int = 128 * 2**20
    label: str = ""
    routes: list[str] = field(default_factory=list)            # the job routes
    control_routes: list[str] = field(default_factory=list)    # POST routes that are not jobs
    limits: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int = 1
    dry_run_supported: bool | None = None     # None: not known yet
    up: bool = False
    session: aiohttp.ClientSession | None = None

    def model_info(self) -> ModelInfo:
        """What this unit announces of its model: routes, and the limits a submit is checked by."""
        return ModelInfo(self.label, self.label.split("/", 1)[0], self.routes,
                         {k: self.limits[k] for k in ("max_body_bytes", "max_pixels") if k in self.limits},
                         self.control_routes)

    def headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.settings.api_key_env and os.environ.get(self.settings.api_key_env):
            h["x-api-key"] = os.environ[self.settings.api_key_env]
        return h

    def open(self) -> None:
        """aiohttp, not httpx, for this hop: about 0.3 ms a call here against 1 ms (bench/jobs_bench.py).
        Idle connections are dropped after 2 s, before the service's own keep-alive timeout
        closes them: a request sent on a connection the server is closing reads as a crash."""
        n = self.max_in_flight + 4
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=n, limit_per_host=n, keepalive_timeout=2.0), trust_env=False,
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=self.run_timeout_s, sock_connect=5.0))

    async def reset(self) -> None:
        """After a crash: no job is sent before the service answers /readyz again, and never on
        a connection pooled before (the loop may not have seen the dead process close it yet:
        a job sent on it would read as another crash). A request still on the old session
        fails as not sent."""
        self.up = False
        old, self.session = self.session, None
        if old is not None:
            await old.close()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def request(self, method: str, route: str, body: bytes | None = None, headers: dict | None = None,
                      timeout: float | None = None) -> Answer:
        if not valid_route(route):  # checked at submit; checked again: a queue entry is not trusted
            raise ValueError(f"not a route: {route[:80]!r}")
        if self.session is None or self.session.closed:
            self.open()
        session = self.session
        kw = {"timeout": aiohttp.ClientTimeout(total=timeout, sock_connect=5.0)} if timeout else {}
        limit = self.max_result_bytes
        headers = headers or self.headers()
        data: Any = body
        if body is not None and len(body) >= STREAMED_BODY_BYTES:
            data = _pieces(memoryview(body))   # with its length declared: not chunked
            headers = {**headers, "Content-Length": str(len(body))}
        try:
            if session.closed:
                raise TargetNotSent(f"{self.name}: its connections were reset")
            async with session.request(method, self.url + route, data=data, headers=headers,
                                            allow_redirects=False, **kw) as resp:
                if (resp.content_length or 0) > limit:
                    raise ResultTooLarge(f"{self.name} answered {resp.content_length} bytes, over max_result_bytes "
                                         f"({limit})")
                buf = bytearray()
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    if len(buf) > limit:  # an answer without Content-Length: stop reading at the limit
                        raise ResultTooLarge(f"{self.name} answered over max_result_bytes ({limit})")
                return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, bytes(buf))
        except TimeoutError as exc:
            raise TargetTimeout(f"{self.name}: no answer in time") from exc
        except aiohttp.ClientConnectorError as exc:
            raise TargetNotSent(f"{self.name}: {why(exc)}") from exc
        except RuntimeError as exc:  # "Session is closed": reset by a crash before this request left
            if not session.closed:
                raise
            raise TargetNotSent(f"{self.name}: its connections were reset") from exc
        except aiohttp.ClientError as exc:
            raise TargetCrashed(f"{self.name}: {why(exc)}") from exc

    async def discover(self) -> None:
        """Wait until the service is ready, then learn its label, routes and limits."""
        await self.wait_up()
        info = (await self.request("GET", "/info", timeout=10)).json()
        self.label = model_label(self.name, info, self.settings.model_label)
        # Only a 404 says "no document". A timeout or a 5xx is a moment, not a property: taken as
        # "no routes", it would fail every job of this model on every unit until a restart.
        r = await self.request("GET", "/openapi.json", timeout=10)
        if r.status == 404:
            doc = None
        elif r.status != 200:
            raise TargetUnreachable(f"{self.name}: /openapi.json answered {r.status}")
        else:
            try:
                doc = r.json()
            except ValueError:
                doc = None  # a document that is not JSON declares nothing
        self.routes, self.control_routes = job_routes(doc) if isinstance(doc, dict) else ([], [])
        declared = self.settings.routes
        if declared is not None:
            if isinstance(doc, dict):  # both: the declared ones the document has as job routes
                missing = sorted(set(declared) - set(self.routes))
                if missing:
                    log.warning("jobs: %s's OpenAPI document has no JSON POST route %s; not job routes", self.name,
                                missing)
                self.routes = sorted(set(declared) & set(self.routes))
            else:
                self.routes = sorted(set(declared))
        elif not isinstance(doc, dict):
            log.warning("jobs: %s publishes no OpenAPI document and targets.%s.routes is not set: no job can "
                        "run on it", self.name, self.name)
        self.limits = numeric_limits(info.get("limits"))
        batch = int(self.limits.get("max_batch_size") or 1)
        self.max_in_flight = self.settings.max_in_flight or max(2, batch + 1)
        await self.close()
        self.open()  # sized for max_in_flight now that it is known
        log.info("jobs: target %s at %s serves %s (routes %s, %d at once)", self.name, self.url, self.label,
                 self.routes, self.max_in_flight)

    async def wait_up(self) -> None:
        """Return once /readyz answers 200; back off while it does not."""
        delay = BACKOFF_MIN_S
        while True:
            try:
                if (await self.request("GET", "/readyz", timeout=5)).status == 200:
                    self.up = True
                    return
            except (TargetUnreachable, TargetTimeout):
                pass
            self.up = False
            await asyncio.sleep(delay)
            delay = min(BACKOFF_MAX_S, delay * 2)

    async def call(self, route: str, body: bytes, job_id: str, trace: dict[str, str] | None = None) -> Answer:
        """Run a job; cancelling the awaiting task closes the connection, which the service
        takes as its client leaving (it drops the job or stops between steps). ``trace``: the
        attempt's traceparent (and tracestate), which parents the service's request span."""
        return await self.request("POST", route, body, {**self.headers(), **(trace or {}), JOB_HEADER: job_id})

    async def dry_run(self, route: str, body: bytes, trace: dict[str, str] | None = None) -> DryRun:
        """The service's verdict on a body without running it: an ApiError to return to the
        submitter, or none (valid, or the service cannot tell: structural checks stand), and
        what the answer will weigh when the service says (cost.output_bytes)."""
        if not self.settings.dry_run or self.dry_run_supported is False:
            return DryRun()
        try:
            r = await self.request("POST", route, body, {**self.headers(), **(trace or {}), DRY_RUN_HEADER: "1"},
                                   timeout=self.dry_run_timeout_s)
        except TargetTimeout:
            self.dry_run_supported = False  # it ran the real thing: never ask again
            return DryRun()
        except (TargetUnreachable, ResultTooLarge):
            return DryRun()
        if 200 <= r.status < 300:
            try:
                doc = r.json()
                valid = doc.get("valid") is True
            except (ValueError, AttributeError):
                doc, valid = None, False
            if not valid and self.dry_run_supported is None:
                log.warning("jobs: %s does not support %s; submits get structural checks only", self.name,
                            DRY_RUN_HEADER)
            self.dry_run_supported = valid
            return DryRun(output_bytes=output_bytes(doc) if valid else None)
        if 400 <= r.status < 500 and r.status not in (401, 403, 408, 429):
            err = r.error()
            return DryRun(ApiError(r.status, err["code"], err["message"]))
        return DryRun()


@dataclass
class DryRun:
    error: ApiError | None = None
    output_bytes: int | None = None     # the service's estimate of its answer's size


def output_bytes(doc: Any) -> int | None:
    """cost.output_bytes of a dry run's answer, when it is a sane number of bytes."""
    cost = doc.get("cost") if isinstance(doc, dict) else None
    value = cost.get("output_bytes") if isinstance(cost, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**40:
        return None
    return int(value)


async def _pieces(view: memoryview):
    for at in range(0, len(view), BODY_PIECE_BYTES):
        yield view[at:at + BODY_PIECE_BYTES]

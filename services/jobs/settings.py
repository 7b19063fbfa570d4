"""The jobs service's settings (``[services.jobs.settings]``): pydantic only, no heavy import,
so that ``onecard check`` validates the section before anything starts.

The issue's ``[queue]`` table lives here as ``[services.jobs.settings.queue]``: without a
``url`` the jobs stay in the process's memory (embedded mode); with one they go on Redis
Streams, one stream per model label.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.runtime.settings import ServiceSettings, StartupConfigError

# always with fullmatch: with match, "$" also matches before a trailing newline
LABEL_RE = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+/[A-Za-z0-9_.+-]+")
URL_RE = re.compile(r"https?://[^\s/]+(:\d+)?/?")
# a route: plain segments only; no empty, "." or ".." segment, no query, no escapes
ROUTE_RE = re.compile(r"(/[A-Za-z0-9_.-]+)+")


def valid_route(route: str) -> bool:
    return len(route) <= 256 and ROUTE_RE.fullmatch(route) is not None \
        and not any(set(seg) == {"."} for seg in route.split("/")[1:])


def redact(url: str) -> str:
    """The password masked up to the last '@', which also covers an unencoded '/' in it."""
    head, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{head}://{creds.split(':', 1)[0]}:***@{host}"


def redis_url_problem(url: str) -> str | None:
    """What makes a Redis URL unusable, never quoting it (it may hold a password). An
    unencoded '/', '?' or '#' in a password moves the rest into the path: redis-py then
    fails on a piece of the password as a port, or quietly connects to localhost."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return "expected redis://host:port/db, rediss://... or unix://..."
    if url.startswith("unix://"):
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        parts = None
    if parts is None or not parts.hostname or "@" in parts.path + parts.query + parts.fragment:
        return ("the Redis URL does not parse as redis://[user:password@]host:port/db (percent-encode a "
                "'/', '?', '#' or '@' in the password)")
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class QueueSettings(_Strict):
    url: str | None = Field(None, description="redis://[user:password@]host:port/db; absent: jobs stay in memory")
    url_env: str | None = Field(None, description="...or read the URL from this environment variable (a Secret)")
    results_ttl_s: float = Field(3600.0, gt=0, le=30 * 86400, description="finished jobs and results expire after this")
    visibility_timeout_s: float = Field(60.0, ge=0.5, le=86400,
                                        description="a running job whose unit stopped renewing it is re-run after this")
    max_attempts: int = Field(3, ge=1, le=100, description="runs that ended in a 5xx, a timeout or a lost unit; "
                              "then the job fails and goes to the dead-letter stream")
    idempotency_ttl_s: float = Field(86400.0, gt=0, le=30 * 86400,
                                     description="how long an Idempotency-Key is remembered")
    prefix: str = Field("onecard:jobs", pattern=r"^[A-Za-z0-9_:.-]{1,64}$", description="key prefix in Redis")
    group: str = Field("onecard", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="consumer group on every stream")
    dead_letter_maxlen: int = Field(10_000, ge=1, description="dead-letter entries kept per stream (approximate trim)")
    op_timeout_s: float = Field(5.0, gt=0, le=300, allow_inf_nan=False,
                                description="deadline of one Redis operation (a hung Redis: 503 queue_unavailable)")
    max_connections: int = Field(64, ge=1, le=10_000, description="Redis connections the API and the state writes "
                                 "share; a request waits for a free one within op_timeout_s")
    max_finished_jobs: int = Field(100_000, ge=1, le=100_000_000, description="embedded queue: finished jobs "
                                   "kept in memory; beyond, the oldest finished are forgotten before results_ttl_s")
    max_results_bytes: int = Field(2**30, ge=1024, le=2**40, description="embedded queue: bytes of results kept "
                                   "in memory, each finished job's record counted with its result (12 KiB); beyond, "
                                   "the oldest finished jobs are forgotten (left at the default, "
                                   "sized with max_queued_bytes from the service's memory budget)")
    results_dir: str | None = Field(None, max_length=4096, description="embedded queue: where finished jobs' results "
                                    "are kept as files, in a private directory made at start and removed at stop, "
                                    "not in the process's memory (default: the system's temporary directory, "
                                    "$TMPDIR); \"\": in memory. A write that fails keeps that result in memory")
    max_queued_bytes: int = Field(2**30, ge=1024, le=2**40, description="embedded queue: bytes of the bodies of "
                                  "queued and running jobs; a submit beyond waits for room (queue_wait_s), then "
                                  "gets 503 queue_full (left at the default, sized from the service's memory budget)")
    retry_backoff_s: float = Field(1.0, ge=0, le=3600, allow_inf_nan=False, description="a failed attempt is "
                                   "retried after this, doubled at each attempt (0: at once)")
    retry_backoff_max_s: float = Field(60.0, ge=0, le=86400, allow_inf_nan=False,
                                       description="the longest wait between two attempts")
    retry_jitter: float = Field(0.5, ge=0, le=1, allow_inf_nan=False, description="each wait is drawn from "
                                "[backoff * (1 - jitter), backoff]: jobs that failed together come back apart")
    max_idempotency_keys: int = Field(100_000, ge=1, le=100_000_000, description="embedded queue: Idempotency-Keys "
                                      "remembered; beyond, the oldest are forgotten before idempotency_ttl_s")
    max_memory_bytes: int = Field(0, ge=0, le=2**50, description="Redis: bytes the queue may fill (bodies, results "
                                  "reserved for accepted jobs, stored results); 0: Redis's own maxmemory")
    memory_headroom: float = Field(0.1, ge=0, lt=1, allow_inf_nan=False, description="Redis: the share of maxmemory "
                                   "kept free for Redis itself (stream entries, client buffers, fragmentation)")
    announce_period_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False, description="how often a unit checks "
                                     "that its models are announced (and that Redis kept its data)")

    def resolved_url(self, environ=os.environ) -> str | None:
        """The Redis URL, or None for the embedded queue. A url_env naming a variable that is
        unset or empty is a configuration error: a unit meant to share a queue must not
        quietly run alone on its memory."""
        if self.url:
            return self.url
        if self.url_env:
            url = environ.get(self.url_env, "").strip()
            if not url:
                raise StartupConfigError(f"queue.url_env: the environment variable {self.url_env} is not set or "
                                         "empty; set it to redis://host:port/db, or remove url_env to keep the "
                                         "jobs in memory")
            problem = redis_url_problem(url)
            if problem:
                raise StartupConfigError(f"queue.url_env: {self.url_env}: {problem}")
            return url
        return None

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        problem = v is not None and redis_url_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class TargetSettings(_Strict):
    url: str | None = Field(None, description="the local service's base URL (ONECARD_UNIT_SERVICES wins)")
    model_label: str | None = Field(None, description="override the label the service reports in /info")
    max_in_flight: int | None = Field(None, ge=1, le=10_000, description="jobs sent to it at once "
                                      "(default: its max_batch_size + 1)")
    api_key_env: str | None = Field(None, description="environment variable holding the service's API key")
    dry_run: bool = Field(True, description="validate submits with the service's X-Onecard-Dry-Run when it has one")
    routes: list[str] | None = Field(None, max_length=256, description="the POST routes jobs may use; required "
                                     "for a service without an OpenAPI document (then no route is a job route)")

    @field_validator("routes")
    @classmethod
    def _routes(cls, v: list[str] | None) -> list[str] | None:
        for route in v or ():
            if not valid_route(route):
                raise ValueError(f"{route!r}: expected a path such as /api/v1/img2img")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not URL_RE.fullmatch(v):
            raise ValueError("expected http://host:port")
        return v

    @field_validator("model_label")
    @classmethod
    def _label(cls, v: str | None) -> str | None:
        if v is not None and not LABEL_RE.fullmatch(v):
            raise ValueError("expected 'service/backend/model' (letters, digits, '_', '-', '.')")
        return v


class JobsSettings(ServiceSettings):
    """The jobs service's own keys; the edge's limits, auth and health come from ServiceSettings."""

    queue: QueueSettings = Field(default_factory=QueueSettings)
    targets: dict[str, str | TargetSettings] = Field(
        default_factory=dict, description="local services by name: a URL or a table (url, model_label, ...)")
    consume: bool = Field(True, description="run jobs on this unit's services (false: an API-only unit)")
    node_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,128}$",
                                  description="this unit's name in job states (default: $ONECARD_NODE_NAME from "
                                  "[services.jobs.env], "
                                  "$HOSTNAME, the host name)")
    accept_models: list[str] = Field(default_factory=list, description="model labels accepted at submit before "
                                     "any unit has announced them (units scaled to zero)")
    default_models: dict[str, str] = Field(default_factory=dict,
                                           description="service name -> model label used when a job names none")
    # one picture of max_image_bytes in base64 (26.7 MiB) and 1.3 MiB of the rest: a body past
    # that could never pass the image check, and reading 200 of them whole (32 MiB) took
    # the two cores from every service's probes
    max_body_bytes: int = Field(28 * 2**20, ge=1024, description="larger submit bodies get 413 (one "
                                "max_image_bytes picture in base64 and 1.3 MiB of the rest)")
    max_image_bytes: int = Field(20 * 2**20, ge=1024, description="a decoded image over this gets 413")
    max_pixels: int = Field(40_000_000, ge=1, description="an image over this many pixels (from its header) gets 413")
    max_queued_jobs: int = Field(10_000, ge=1, description="queued jobs per model; a submit "
                                 "beyond waits for room (queue_wait_s), then gets 503 queue_full")
    run_timeout_s: float = Field(900.0, gt=0, le=86400, description="one run on the local service, at most")
    backpressure_requeue_s: float = Field(30.0, gt=0, le=3600, description="a job the local service keeps "
                                          "refusing with 503 goes back on the queue after this")
    dry_run_timeout_s: float = Field(10.0, gt=0, le=600, description="time limit of a submit's dry run")
    drain_s: float | None = Field(None, ge=0, le=3600, description="on SIGTERM, wait this long for running jobs "
                                  "(default: $ONECARD_DRAIN_S, else 70 % of the supervisor's grace_s); the rest "
                                  "go back on the queue")
    max_wait_s: float = Field(10.0, ge=0, le=300, description="longest GET /v1/jobs/{id}?wait= (long poll)")
    # a long poll holds its connection with a request in progress, which never makes room at
    # max_connections: 600 clients long-polling took every connection of the port, /healthz's too
    max_waiting_polls: int = Field(128, ge=0, le=100_000, description="long polls waiting at once; beyond, a poll "
                                   "is answered with the job as it is after 0.5-1 x retry_after_s (at once when "
                                   "finished; its connection then idles between requests and may make room for a "
                                   "newcomer, and a client polling in a loop comes back no faster)")
    retry_after_s: int = Field(1, ge=0, le=3600, description="Retry-After on 503 and on unfinished results")
    max_json_depth: int = Field(33, ge=3, le=1000, description="a submit whose JSON nests deeper gets 400 "
                                "json_too_deep (the envelope adds one level to a service's own body limit of 32)")
    max_result_bytes: int = Field(128 * 2**20, ge=1024, le=2**31, description="a service's answer over this fails "
                                  "the job (result_too_large); it is not stored")
    result_reserve_bytes: int = Field(16 * 2**20, ge=0, le=2**31, description="room kept for a job's result at "
                                      "submit when the service's dry run does not say (cost.output_bytes)")
    submit_memory_bytes: int = Field(256 * 2**20, ge=2**20, le=2**40, description="memory that submits being read "
                                     "and checked may hold together (3 x each body); beyond, a submit waits its turn "
                                     "before its body is read. A submit takes its share once its body has begun (a "
                                     "100 Continue first when asked for), and one whose body brings nothing for 1 s "
                                     "gets 408 body_stalled as soon as another waits")
    submit_wait_s: float = Field(30.0, ge=0, le=600, allow_inf_nan=False, description="longest a submit waits "
                                 "for room in submit_memory_bytes (first come, first served); then 503 busy "
                                 "(0: 503 at once)")
    queue_wait_s: float = Field(30.0, ge=0, le=600, allow_inf_nan=False, description="longest a submit waits "
                                "for room in the queue (max_queued_jobs, max_queued_bytes, a Redis at its maxmemory) "
                                "once its body is read, in line (first come, first served); then 503 queue_full "
                                "(0: 503 at once)")
    max_result_streams: int = Field(64, ge=1, le=100_000, description="result pieces read from the queue and "
                                    "encoded at once (a slot is held while a piece is read, never while its "
                                    "client is waited for); beyond, a piece waits its turn (result_stream_wait_s)")
    result_stream_wait_s: float = Field(45.0, ge=0, le=600, allow_inf_nan=False, description="longest a piece "
                                        "waits for one of max_result_streams, first come first served; then a poll "
                                        "gets 503 busy and an answer already begun ends short (0: at once)")
    result_send_timeout_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False, description="a client that "
                                         "reads no part of a result for this long is cut off")
    max_list_limit: int = Field(500, ge=1, le=10_000, description="most jobs in one page of GET /v1/jobs")
    max_listings_at_once: int = Field(2, ge=1, le=1000, description="pages of GET /v1/jobs read and encoded at "
                                      "once; more wait their turn, first come first served (each is up to "
                                      "max_list_limit jobs of CPU work that holds the GIL)")
    listed_views_bytes: int = Field(16 * 2**20, ge=0, le=2**31, description="memory kept for finished jobs' "
                                    "encoded views, so that listing them again costs no re-encoding (0: none kept)")

    @field_validator("accept_models")
    @classmethod
    def _labels(cls, v: list[str]) -> list[str]:
        for label in v:
            if not LABEL_RE.fullmatch(label):
                raise ValueError(f"{label!r}: expected 'service/backend/model'")
        return v

    @field_validator("targets")
    @classmethod
    def _target_urls(cls, v: dict[str, str | TargetSettings]) -> dict[str, str | TargetSettings]:
        for name, t in v.items():
            if isinstance(t, str) and not URL_RE.fullmatch(t):
                raise ValueError(f"{name}: expected http://host:port, got {t!r}")
        return v

    @model_validator(mode="after")
    def _defaults_are_labels(self) -> JobsSettings:
        for service, label in self.default_models.items():
            if not LABEL_RE.fullmatch(label) or label.split("/", 1)[0] != service:
                raise ValueError(f"default_models.{service}: expected '{service}/backend/model', got {label!r}")
        if self.max_result_bytes > self.queue.max_results_bytes:
            raise ValueError(f"max_result_bytes ({self.max_result_bytes}) is over queue.max_results_bytes "
                             f"({self.queue.max_results_bytes}): one result would not fit in the store")
        return self

    def target(self, name: str) -> TargetSettings:
        t = self.targets.get(name)
        if t is None:
            return TargetSettings()
        return TargetSettings(url=t) if isinstance(t, str) else t

    def resolved_node_name(self) -> str:
        import socket
        name = self.node_name or os.environ.get("ONECARD_NODE_NAME") or os.environ.get("HOSTNAME") \
            or socket.gethostname()
        return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:128] or "node"

    def resolved_drain_s(self) -> float:
        """The drain must end inside the supervisor's grace (SIGKILL after it): by default
        $ONECARD_DRAIN_S, else 70 % of $ONECARD_GRACE_S, else 7 s."""
        if self.drain_s is not None:
            return self.drain_s
        try:
            if os.environ.get("ONECARD_DRAIN_S"):
                return max(0.0, float(os.environ["ONECARD_DRAIN_S"]))
            if os.environ.get("ONECARD_GRACE_S"):
                return max(0.0, 0.7 * float(os.environ["ONECARD_GRACE_S"]))
        except ValueError:
            pass
        return 7.0


SERVICE_SETTINGS = JobsSettings

"""Redis Streams backend (redis-py asyncio): one stream per model label and priority level,
one consumer group, at-least-once delivery with exactly one stored result.

A consumer reads its model's streams, the highest level first, only when its service has
room (redis_consume.py); a running job's lease is renewed so that its entry's idle time
stays under ``visibility_timeout_s``; entries idle longer (their unit died or stalled) are
taken over by a unit that has room, and the old run, fenced by its lease, can no longer
write. Every state change is one Lua script (redis_scripts.py). Cancels reach the running
unit over pub/sub. What a job may cost Redis (its body, and the room reserved for its result)
is checked against the queue's memory budget when it is submitted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError, ResponseError

from services.jobs import redis_scripts as lua
from services.jobs.broker import (
    Broker,
    IdempotencyMismatch,
    JobTooLarge,
    ModelInfo,
    QueueFull,
    QueueRefusesWrites,
    QueueUnavailable,
)
from services.jobs.policy import RetryPolicy
from services.jobs.records import LEVELS, NORMAL, NewJob, Submitted, valid_id
from services.jobs.redis_consume import RedisConsuming, _s, deadline
from services.jobs.redis_errors import is_full, is_outage, refusal_reason
from services.jobs.settings import QueueSettings, redact

log = logging.getLogger("onecard.jobs")
MAX_BLOCK_S = 5.0
CURSOR_RE = re.compile(r"(-?[0-9]+):([0-9a-f]{32})")
SCORE_BOUND = 10**18  # index scores are microseconds; a hand-made inf or 1e300 is clamped


def _cursor(last: tuple[bytes, float]) -> str:
    """The next page's cursor after `last` (member, score): always one the API takes back. A
    member that is no job id (written by hand) leaves only its score to go on from."""
    member, score = last
    score = max(-SCORE_BOUND, min(SCORE_BOUND, score)) if score == score else 0
    job_id = _s(member)
    return f"{int(score)}:{job_id if valid_id(job_id) else '0' * 32}"


def _record(raw: dict, job_id: str) -> dict[str, str]:
    """A job's record as text: the job its key names, whatever its own id field says (or lacks)."""
    return {**{_s(k): _s(v) for k, v in raw.items()}, "id": job_id}


class RedisBroker(RedisConsuming, Broker):
    mode = "redis"

    def __init__(self, url: str, settings: QueueSettings, node: str, max_queued: int,
                 policy: RetryPolicy | None = None, clock: Callable[[], float] = time.time):
        Broker.__init__(self, policy or RetryPolicy.from_settings(settings))
        self.url, self.settings, self.node, self.max_queued, self.clock = url, settings, node, max_queued, clock
        self.p, self.group = settings.prefix, settings.group
        self.consumer = f"{node}-{os.getpid()}-{os.urandom(3).hex()}"
        self.channel = f"{self.p}:cancel"
        self.done_channel = f"{self.p}:done"
        self.visibility_ms = int(settings.visibility_timeout_s * 1000)
        self.ttl_ms = int(settings.results_ttl_s * 1000)
        self.reclaim_period_s = max(0.2, settings.visibility_timeout_s / 2)
        self.block_s = min(MAX_BLOCK_S, self.reclaim_period_s)
        op_s = settings.op_timeout_s
        kw = dict(socket_connect_timeout=min(2.0, op_s), health_check_interval=15,
                  retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2))

        def pool(socket_timeout: float | None) -> aioredis.Redis:
            # bounded: a flood of requests waits (within op_timeout_s) for one of
            # max_connections, instead of opening a connection each until Redis refuses
            return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
                url, max_connections=settings.max_connections, timeout=op_s, socket_timeout=socket_timeout, **kw))
        self.r = pool(op_s)
        # blocking reads hold their connection for block_s: their own pool, a longer timeout
        self.blocking = pool(self.block_s + op_s)
        # one pub/sub connection, idle by nature (no read timeout): TCP keepalive finds a peer that
        # vanished without a reset, so the listener reconnects instead of waiting forever
        keepalive = {o: v for o, v in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
                     if hasattr(socket, o)}
        self.listener = aioredis.from_url(url, socket_timeout=None, socket_keepalive=True, socket_keepalive_options={
            getattr(socket, o): v for o, v in keepalive.items()}, **kw)
        self.scripts = {name: (s, self.r.register_script(s.source)) for name, s in lua.SCRIPTS.items()}
        self._next_reclaim: dict[str, float] = {}
        self._cursor: dict[str, str] = {}
        # (stream, entry) of the runs this unit started and has not ended yet: never taken
        # over by itself (see RedisConsumer._reclaim)
        self._running_entries: set[tuple[str, str]] = set()
        self._listen_task: asyncio.Task | None = None
        self._models_cache: tuple[float, dict[str, ModelInfo]] | None = None

    # ---- keys -----------------------------------------------------------------------
    def job_key(self, job_id: str) -> str:
        return f"{self.p}:job:{job_id}"

    def body_key(self, job_id: str) -> str:
        return f"{self.p}:body:{job_id}"

    def result_key(self, job_id: str) -> str:
        return f"{self.p}:result:{job_id}"

    def stream(self, label: str, level: str = NORMAL) -> str:
        return f"{self.p}:stream:{label}" if level == NORMAL else f"{self.p}:stream:{label}:{level}"

    def streams(self, label: str) -> list[str]:
        return [self.stream(label, level) for level in LEVELS]

    def delayed_key(self, label: str) -> str:
        return f"{self.p}:delayed:{label}"

    def dead_stream(self, label: str) -> str:
        return f"{self.p}:dead:{label}"

    def index_key(self, label: str, state: str) -> str:
        return f"{self.p}:idx:{state}:{label}"

    def idem_key(self, key: str) -> str:
        return f"{self.p}:idem:{hashlib.sha256(key.encode()).hexdigest()}"

    @property
    def stats_key(self) -> str:
        return f"{self.p}:stats"

    def job_keys(self, job_id: str, label: str) -> dict[str, str]:
        keys = {"job": self.job_key(job_id), "body": self.body_key(job_id), "reserved": f"{self.p}:reserved",
                "dead": self.dead_stream(label), "stats": self.stats_key}
        keys.update({f"idx_{s}": self.index_key(label, s)
                     for s in ("queued", "running", "succeeded", "failed", "cancelled", "dead")})
        return keys

    def job_args(self, job_id: str, label: str) -> dict[str, Any]:
        now = self.clock()
        return {"job_id": job_id, "now": repr(now), "now_ms": int(now * 1000), "ttl_ms": self.ttl_ms, "label": label,
                "dead_maxlen": self.settings.dead_letter_maxlen, "done_channel": self.done_channel}

    def budget_args(self) -> dict[str, Any]:
        return {"budget": self.settings.max_memory_bytes, "headroom": self.settings.memory_headroom}

    # ---- scripts and refusals ---------------------------------------------------------
    async def _call(self, name: str, keys: dict[str, Any], args: dict[str, Any], extra_keys=(), extra_args=()) -> Any:
        script, runner = self.scripts[name]
        k, a = script.bind(keys, args, extra_keys, extra_args)
        try:
            out = await runner(keys=k, args=a)
        except ResponseError as exc:
            if not is_outage(exc):
                raise  # a script error is a bug, not an outage
            reason = refusal_reason(exc)
            if reason:
                self._refused(reason)
                raise QueueRefusesWrites(f"Redis refuses writes: {reason}") from exc
            raise QueueUnavailable(str(exc)) from exc
        if self.refusal is not None and script.denies_oom:  # a write that a full Redis would have refused
            log.info("jobs: Redis takes writes again")
            self.refusal = None
        return out

    def _refused(self, reason: str) -> None:
        self.refusals[reason] += 1
        if self.refusal != reason:
            log.error("jobs: Redis refuses writes (%s): no new job can be accepted; jobs already accepted "
                      "still move on (their writes may cross maxmemory)", reason)
        self.refusal = reason

    async def refuses_writes(self) -> str | None:
        """A plain write, refused by a Redis at its maxmemory as a new job would be."""
        try:
            await asyncio.wait_for(self.r.set(f"{self.p}:probe:{self.consumer}", b"1", px=10_000),
                                   self.settings.op_timeout_s)
        except ResponseError as exc:
            reason = refusal_reason(exc)
            if reason:
                self._refused(reason)
                return reason
            return None
        except (TimeoutError, RedisError, OSError):
            return None  # not reachable: ping says so
        if self.refusal is not None:
            log.info("jobs: Redis takes writes again")
            self.refusal = None
        return None

    # ---- lifecycle --------------------------------------------------------------------
    @deadline
    async def start(self) -> None:
        await self.r.ping()
        self._listen_task = asyncio.get_running_loop().create_task(self._listen(), name="jobs-cancel-listener")

    async def close(self) -> None:
        if self._listen_task is not None:
            self._listen_task.cancel()
            await asyncio.gather(self._listen_task, return_exceptions=True)
        for client in (self.r, self.blocking, self.listener):
            await client.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.r.ping(), 2))
        except (TimeoutError, RedisError, OSError):
            return False

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {"mode": self.mode, "url": redact(self.url), "prefix": self.p, "group": self.group,
                "consumer": self.consumer, "visibility_timeout_s": s.visibility_timeout_s,
                "max_attempts": s.max_attempts, "retry_backoff_s": s.retry_backoff_s,
                "retry_backoff_max_s": s.retry_backoff_max_s, "results_ttl_s": s.results_ttl_s,
                "idempotency_ttl_s": s.idempotency_ttl_s, "op_timeout_s": s.op_timeout_s,
                "max_connections": s.max_connections, "max_memory_bytes": s.max_memory_bytes,
                "refuses_writes": self.refusal}

    async def _listen(self) -> None:
        delay = 0.1
        while True:
            pubsub = self.listener.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel, self.done_channel)
                delay = 0.1
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        if _s(msg["channel"]) == self.channel:
                            self._notify_cancel(_s(msg["data"]))
                        else:
                            self._notify_done(_s(msg["data"]))
            except (RedisError, OSError) as exc:
                log.warning("jobs: cancel channel lost (%s); reconnecting", exc)
            finally:
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass
            await asyncio.sleep(delay)  # back off while Redis is away
            delay = min(2.0, delay * 2)

    # ---- the API side -------------------------------------------------------------
    async def _replay(self, raw: bytes, job: NewJob) -> Submitted:
        """An Idempotency-Key seen before (kept for idempotency_ttl_s, longer than its job)."""
        try:
            known = json.loads(raw)
            known_id, sha, model = str(known["id"]), known.get("sha"), str(known.get("model") or "")
        except (ValueError, KeyError, TypeError):
            known_id, sha, model = _s(raw), None, ""  # written by an older version: the id alone
        state, job_sha = await self.r.hmget(self.job_key(known_id), "state", "request_sha")
        if (sha or (job_sha and _s(job_sha))) not in (None, job.request_sha):
            raise IdempotencyMismatch(known_id)
        return Submitted(known_id, _s(state) if state else "expired", False, model)

    @deadline
    async def submit(self, job: NewJob, label: str) -> Submitted:
        idem = self.idem_key(job.idempotency_key) if job.idempotency_key else self.idem_key("-")
        value = json.dumps({"id": job.id, "sha": job.request_sha, "model": label}) if job.idempotency_key else ""
        fields = {"id": job.id, "service": job.service, "route": job.route, "model": label, "priority": job.priority,
                  "attempts": "0", "runs": "0", "created_at": repr(job.created_at), "request_sha": job.request_sha,
                  "progress": "0", **(job.trace or {})}
        for _ in range(5):
            if job.idempotency_key:
                known = await self.r.get(idem)
                if known is not None:
                    return await self._replay(known, job)
            try:
                out = await self._call("SUBMIT", {"stream": self.stream(label, job.priority), "idem": idem,
                                                  **self.job_keys(job.id, label)},
                                       {"body": job.body, "idem_value": value,
                                        "idem_ttl_ms": int(self.settings.idempotency_ttl_s * 1000),
                                        "group": self.group, "max_queued": self.max_queued,
                                        "fields": json.dumps(fields), "reserve": job.reserve,
                                        **self.budget_args(), **self.job_args(job.id, label)})
            except QueueRefusesWrites as exc:
                if is_full(exc.__cause__):  # noeviction at maxmemory: reachable but full, which the client hears
                    raise QueueFull("Redis is at its maxmemory and refuses new jobs") from exc
                raise
            verdict = _s(out[0])
            if verdict == "full":
                raise QueueFull(f"{self.max_queued} jobs are already waiting for {label}")
            if verdict == "nomem":
                used, reserved, budget = (int(_s(x)) for x in out[1:4])
                need = len(job.body) + job.reserve
                if need > budget:
                    raise JobTooLarge(f"the job needs {need} bytes of the queue (its body, {len(job.body)}, and "
                                      f"{job.reserve} kept for its result), over the queue's whole budget of "
                                      f"{budget} bytes")
                raise QueueFull(f"the queue has no room for this job now: its body ({len(job.body)} bytes) and the "
                                f"room kept for its result ({job.reserve}) would take Redis over its budget ({used} "
                                f"bytes used, {reserved} reserved for accepted jobs, of {budget})")
            if verdict == "ok":
                return Submitted(job.id, "queued", True, label)
        raise QueueUnavailable("the Idempotency-Key kept racing")

    @deadline
    async def get(self, job_id: str) -> dict[str, str] | None:
        raw = await self.r.hgetall(self.job_key(job_id))
        return _record(raw, job_id) if raw else None

    @deadline
    async def result(self, job_id: str) -> bytes | None:
        return await self.r.get(self.result_key(job_id))

    @deadline
    async def result_size(self, job_id: str) -> int | None:
        async with self.r.pipeline(transaction=False) as pipe:
            size, exists = await pipe.strlen(self.result_key(job_id)).exists(self.result_key(job_id)).execute()
        return int(size) if exists else None

    @deadline
    async def result_chunk(self, job_id: str, start: int, size: int) -> bytes:
        return await self.r.getrange(self.result_key(job_id), start, start + size - 1) if size > 0 else b""

    @deadline
    async def cancel(self, job_id: str) -> tuple[str, dict[str, str]] | None:
        model = await self.r.hget(self.job_key(job_id), "model")
        if model is None:
            return None
        label = _s(model)
        verdict = _s(await self._call("CANCEL", self.job_keys(job_id, label),
                                      {"cancel_channel": self.channel, **self.job_args(job_id, label)}))
        fields = await self.get(job_id) if verdict != "missing" else None
        return (verdict, fields) if fields else None

    @deadline
    async def list_jobs(self, label: str, state: str, limit: int, cursor: str | None
                        ) -> tuple[list[dict[str, str]], str | None]:
        key = self.index_key(label, state)
        start = 0
        if cursor:
            m = CURSOR_RE.fullmatch(cursor)
            if m is None:
                raise ValueError("not a cursor of this queue")
            rank = await self.r.zrank(key, m.group(2))
            if rank is None:  # the job left the state meanwhile: start at its score
                first = await self.r.zrangebyscore(key, int(m.group(1)), "+inf", start=0, num=1)
                rank = await self.r.zrank(key, first[0]) if first else None
                start = rank if rank is not None else await self.r.zcard(key)
            else:
                start = rank + 1
        members = await self.r.zrange(key, start, start + limit, withscores=True)
        page, more = members[:limit], len(members) > limit
        async with self.r.pipeline(transaction=False) as pipe:
            for member, _ in page:
                pipe.hgetall(self.job_key(_s(member)))
            records = await pipe.execute() if page else []
        jobs, gone = [], []
        for (member, _), raw in zip(page, records, strict=False):
            job_id = _s(member)
            if raw and valid_id(job_id):
                jobs.append(_record(raw, job_id))  # redrive takes the id from here
            else:
                gone.append(member)
        if gone:  # expired records, and entries that name no job the API could give: they go
            await self.r.zrem(key, *gone)
        nxt = _cursor(page[-1]) if more and page else None
        return jobs, nxt

    @deadline
    async def redrive(self, job_id: str) -> str:
        model, priority = await self.r.hmget(self.job_key(job_id), "model", "priority")
        if model is None:
            return "missing"
        label, level = _s(model), _s(priority) if priority else NORMAL
        try:
            return _s(await self._call("REDRIVE", {"stream": self.stream(label, level), **self.job_keys(job_id, label)},
                                       {"group": self.group, **self.budget_args(), **self.job_args(job_id, label)}))
        except QueueRefusesWrites:
            return "nomem"

    @deadline
    async def models(self) -> dict[str, ModelInfo]:
        now = time.monotonic()
        if self._models_cache and now - self._models_cache[0] < 2.0:
            return self._models_cache[1]
        raw = await self.r.hgetall(f"{self.p}:models")
        out = {}
        for k, v in raw.items():
            try:
                out[_s(k)] = ModelInfo.from_json(json.loads(v))
            except (ValueError, KeyError, TypeError):
                continue
        self._models_cache = (now, out)
        return out

    async def _announce(self, label: str, info: str) -> tuple[int, str]:
        changed, epoch = await self._call(
            "ANNOUNCE", {"models": f"{self.p}:models", "epoch": f"{self.p}:epoch"},
            {"label": label, "info": info, "group": self.group, "epoch": os.urandom(8).hex()},
            extra_keys=self.streams(label) if label else ())
        return int(changed), _s(epoch)

    @deadline
    async def announce(self, info: ModelInfo) -> bool:
        changed, _ = await self._announce(info.label, json.dumps(info.to_json(), sort_keys=True))
        if changed:
            self._models_cache = None
        return changed == 1

    @deadline
    async def epoch(self) -> str | None:
        return (await self._announce("", ""))[1]

"""Redis Streams backend (redis-py asyncio): one stream per model label, one consumer
group, at-least-once delivery with exactly one stored result.

A consumer reads with a blocking XREADGROUP (no polling) only when its service has room;
a running job's lease is renewed with XCLAIM so that its idle time stays under
``visibility_timeout_s``; entries idle longer (their unit died) are taken over with
XAUTOCLAIM by a unit that has room. Every state change is one Lua script
(services/jobs/redis_scripts.py). Cancels reach the running unit over pub/sub.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import socket
import time
from typing import Any, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError, ResponseError

from services.jobs import redis_scripts as lua
from services.jobs.broker import Broker, IdempotencyMismatch, ModelInfo, QueueFull, QueueUnavailable, Submitted
from services.jobs.redis_errors import is_full, is_outage
from services.jobs.records import QUEUED, Delivery, NewJob, Outcome, valid_id
from services.jobs.settings import QueueSettings, redact

log = logging.getLogger("onecard.jobs")
MAX_BLOCK_S = 5.0


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _deadline(method):
    """Every Redis operation ends within op_timeout_s (plus the blocking read's own wait for
    take): a Redis that hangs (stopped, swapping, a network that drops packets) is
    QueueUnavailable, a 503 for the API and a retry for the consumer, never a hung request.
    A command cut mid-way closes its connection (redis-py), so no reply is read out of turn."""
    extra = method.__name__ == "take"

    @functools.wraps(method)
    async def bounded(self, *args, **kwargs):
        limit = self.settings.op_timeout_s + (self.block_s if extra else 0.0)
        try:
            async with asyncio.timeout(limit):
                return await method(self, *args, **kwargs)
        except TimeoutError:
            raise QueueUnavailable(f"no answer from Redis within {limit:g} s") from None
    return bounded


class RedisBroker(Broker):
    mode = "redis"

    def __init__(self, url: str, settings: QueueSettings, node: str, max_queued: int,
                 clock: Callable[[], float] = time.time):
        super().__init__()
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
        self.scripts = {name: self.r.register_script(getattr(lua, name))
                        for name in ("SUBMIT", "START", "RENEW", "FINISH", "REQUEUE", "CANCEL", "DISCARD")}
        self._next_reclaim: dict[str, float] = {}
        self._cursor: dict[str, str] = {}
        self._listen_task: asyncio.Task | None = None
        self._models_cache: tuple[float, dict[str, ModelInfo]] | None = None

    # ---- keys -----------------------------------------------------------------------
    def job_key(self, job_id: str) -> str:
        return f"{self.p}:job:{job_id}"

    def body_key(self, job_id: str) -> str:
        return f"{self.p}:body:{job_id}"

    def result_key(self, job_id: str) -> str:
        return f"{self.p}:result:{job_id}"

    def stream(self, label: str) -> str:
        return f"{self.p}:stream:{label}"

    def dead_stream(self, label: str) -> str:
        return f"{self.p}:dead:{label}"

    def idem_key(self, key: str) -> str:
        return f"{self.p}:idem:{hashlib.sha256(key.encode()).hexdigest()}"

    @property
    def stats_key(self) -> str:
        return f"{self.p}:stats"

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            if not is_outage(exc):
                raise  # a script error is a bug, not an outage
            raise QueueUnavailable(str(exc)) from exc
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc

    # ---- lifecycle --------------------------------------------------------------------
    @_deadline
    async def start(self) -> None:
        try:
            await self.r.ping()
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc
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
        except (RedisError, OSError, asyncio.TimeoutError):
            return False

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "url": redact(self.url), "prefix": self.p, "group": self.group,
                "consumer": self.consumer, "visibility_timeout_s": self.settings.visibility_timeout_s,
                "max_attempts": self.settings.max_attempts, "results_ttl_s": self.settings.results_ttl_s,
                "op_timeout_s": self.settings.op_timeout_s, "max_connections": self.settings.max_connections}

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
    @_deadline
    async def submit(self, job: NewJob, label: str) -> Submitted:
        idem = self.idem_key(job.idempotency_key) if job.idempotency_key else ""
        try:
            for _ in range(5):
                if idem:
                    known = await self.r.get(idem)
                    if known is not None:
                        state, sha = await self.r.hmget(self.job_key(_s(known)), "state", "request_sha")
                        if state is not None:
                            if _s(sha) != job.request_sha:
                                raise IdempotencyMismatch(_s(known))
                            return Submitted(_s(known), _s(state), False)
                        await self.r.delete(idem)  # its job expired: the key starts afresh
                fields = {"id": job.id, "service": job.service, "route": job.route, "model": label,
                          "attempts": 0, "created_at": repr(job.created_at), "request_sha": job.request_sha,
                          "progress": 0, "state": QUEUED}
                flat = [x for kv in fields.items() for x in kv]
                out = await self._call("SUBMIT", [self.job_key(job.id), self.body_key(job.id), self.stream(label),
                                                  idem or self.idem_key("-")],
                                       [job.id, job.body, "1" if idem else "0",
                                        int(self.settings.idempotency_ttl_s * 1000), self.group, self.max_queued,
                                        repr(self.clock()), *flat])
                verdict = _s(out[0])
                if verdict == "full":
                    raise QueueFull(f"{self.max_queued} jobs are already waiting for {label}")
                if verdict == "ok":
                    return Submitted(job.id, QUEUED, True)
            raise QueueUnavailable("the Idempotency-Key kept racing")
        except (QueueUnavailable, RedisError, OSError) as exc:
            # noeviction at maxmemory: Redis is reachable but full, which the client should hear
            if is_full(exc.__cause__ or exc):
                raise QueueFull("Redis is at its maxmemory and refuses new jobs") from exc
            if isinstance(exc, QueueUnavailable):
                raise
            raise QueueUnavailable(str(exc)) from exc

    @_deadline
    async def get(self, job_id: str) -> dict[str, str] | None:
        try:
            raw = await self.r.hgetall(self.job_key(job_id))
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc
        return {_s(k): _s(v) for k, v in raw.items()} or None

    @_deadline
    async def result(self, job_id: str) -> bytes | None:
        try:
            return await self.r.get(self.result_key(job_id))
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc

    @_deadline
    async def read(self, job_id: str, with_result: bool) -> tuple[dict[str, str], bytes | None] | None:
        """One round trip for both (a result is kept as long as its job)."""
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.job_key(job_id))
                if with_result:
                    pipe.get(self.result_key(job_id))
                res = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc
        fields = {_s(k): _s(v) for k, v in res[0].items()}
        if not fields:
            return None
        return fields, (res[1] if with_result and fields.get("state") == "succeeded" else None)

    @_deadline
    async def cancel(self, job_id: str) -> tuple[str, dict[str, str]] | None:
        verdict = _s(await self._call("CANCEL", [self.job_key(job_id), self.body_key(job_id)],
                                      [repr(self.clock()), self.ttl_ms, self.channel, job_id, self.done_channel]))
        fields = await self.get(job_id) if verdict != "missing" else None
        return (verdict, fields) if fields else None

    @_deadline
    async def models(self) -> dict[str, ModelInfo]:
        now = time.monotonic()
        if self._models_cache and now - self._models_cache[0] < 2.0:
            return self._models_cache[1]
        try:
            raw = await self.r.hgetall(f"{self.p}:models")
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc
        out = {}
        for k, v in raw.items():
            try:
                out[_s(k)] = ModelInfo.from_json(json.loads(v))
            except (ValueError, KeyError, TypeError):
                continue
        self._models_cache = (now, out)
        return out

    @_deadline
    async def announce(self, info: ModelInfo) -> None:
        try:
            await self.r.hset(f"{self.p}:models", info.label, json.dumps(info.to_json()))
            try:
                await self.r.xgroup_create(self.stream(info.label), self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc
        self._models_cache = None

    # ---- the consumer side --------------------------------------------------------
    async def _read(self, label: str, count: int, block_s: float) -> list[tuple[str, dict]]:
        stream = self.stream(label)
        now = time.monotonic()
        if now >= self._next_reclaim.get(label, 0.0):
            self._next_reclaim[label] = now + self.reclaim_period_s
            cursor, entries, *_ = await self.r.xautoclaim(stream, self.group, self.consumer, self.visibility_ms,
                                                           start_id=self._cursor.get(label, "0-0"), count=count)
            self._cursor[label] = _s(cursor)
            entries = [(e, f) for e, f in entries if f is not None]
            if entries:
                log.info("jobs: took over %d job(s) idle for over %.1f s on %s", len(entries),
                         self.settings.visibility_timeout_s, label)
                return [(_s(e), f) for e, f in entries]
        try:
            resp = await self.blocking.xreadgroup(self.group, self.consumer, {stream: ">"}, count=count,
                                                  block=max(1, int(min(block_s, self.block_s) * 1000)))
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.r.xgroup_create(stream, self.group, id="0", mkstream=True)
            return []
        out = []
        for _stream, entries in resp or []:
            out += [(_s(e), f) for e, f in entries]
        return out

    @_deadline
    async def take(self, label: str, count: int, block_s: float) -> list[Delivery]:
        try:
            entries = await self._read(label, count, block_s)
            out = []
            for entry, fields in entries:
                job_id = _s(fields.get(b"id", b""))
                if not valid_id(job_id):
                    await self._call("DISCARD", [self.stream(label), self.dead_stream(label), self.stats_key],
                                     [self.group, entry, "not a job entry", repr(self.clock()),
                                      self.settings.dead_letter_maxlen, label])
                    log.warning("jobs: discarded a malformed entry %s on %s", entry, label)
                    continue
                res = await self._call("START", [self.job_key(job_id), self.body_key(job_id), self.stream(label),
                                                 self.dead_stream(label), self.stats_key],
                                       [self.group, entry, self.node, repr(self.clock()), self.settings.max_attempts,
                                        self.ttl_ms, label, self.settings.dead_letter_maxlen, job_id, self.consumer,
                                        self.done_channel])
                if _s(res[0]) != "run":
                    if _s(res[0]) == "dead":
                        log.warning("jobs: %s failed after %d attempts; dead-lettered", job_id,
                                    self.settings.max_attempts)
                    continue
                queued_at = float(_s(res[3])) if res[3] else None
                out.append(Delivery(job_id, label, _s(res[2]), res[4], int(res[1]), entry, queued_at, self.clock()))
            return out
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc

    @_deadline
    async def renew(self, label: str, deliveries: list[Delivery]) -> set[str]:
        if not deliveries:
            return set()
        flags = await self._call("RENEW", [self.stream(label), *(self.job_key(d.job_id) for d in deliveries)],
                                 [self.group, self.consumer, *(d.entry for d in deliveries)])
        return {d.job_id for d, flag in zip(deliveries, flags) if _s(flag) == "1"}

    @_deadline
    async def finish(self, d: Delivery, outcome: Outcome) -> bool:
        res = await self._call("FINISH", [self.job_key(d.job_id), self.body_key(d.job_id), self.result_key(d.job_id),
                                          self.stream(d.label), self.dead_stream(d.label), self.stats_key],
                               [self.group, d.entry, outcome.state, repr(self.clock()), self.ttl_ms,
                                "1" if outcome.result is not None else "0", outcome.result or b"",
                                outcome.content_type or "", outcome.status or "", json.dumps(outcome.headers),
                                json.dumps(outcome.error) if outcome.error else "",
                                "1" if outcome.dead_letter else "0", d.label, self.settings.dead_letter_maxlen,
                                d.job_id, d.attempt, self.channel, self.done_channel])
        return _s(res) == "ok"

    @_deadline
    async def requeue(self, d: Delivery, error: dict[str, Any] | None, counted: bool) -> str:
        res = await self._call("REQUEUE", [self.job_key(d.job_id), self.body_key(d.job_id), self.stream(d.label),
                                           self.dead_stream(d.label), self.stats_key],
                               [self.group, d.entry, repr(self.clock()), json.dumps(error) if error else "",
                                "1" if counted else "0", self.settings.max_attempts, self.ttl_ms, d.label,
                                self.settings.dead_letter_maxlen, d.job_id, self.done_channel])
        return _s(res)

    @_deadline
    async def stream_stats(self, labels: list[str]) -> list[dict[str, Any]]:
        try:
            pipe = self.r.pipeline(transaction=False)
            for label in labels:
                pipe.xinfo_groups(self.stream(label))
                pipe.xlen(self.stream(label))
                pipe.hget(self.stats_key, f"dead:{label}")
            res = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            raise QueueUnavailable(str(exc)) from exc
        out = []
        for i, label in enumerate(labels):
            groups, length, dead = res[3 * i: 3 * i + 3]
            group = next((g for g in groups if _s(g.get("name")) == self.group), None) \
                if isinstance(groups, list) else None
            length = length if isinstance(length, int) else 0
            pending = int(group["pending"]) if group else 0
            lag = group.get("lag") if group else None
            out.append({"stream": self.stream(label), "model": label,
                        "lag": int(lag) if lag is not None else max(0, length - pending),
                        "pending": pending,
                        "dead_lettered": int(dead) if isinstance(dead, (bytes, str, int)) else 0})
        return out

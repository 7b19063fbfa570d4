"""The consumer side of the Redis backend: taking runs (the highest priority level first,
FIFO within a level), renewing their leases, and writing how they ended.

Waiting for work: a group read on each level, without blocking, in priority order; when all
are empty, a plain XREAD blocks on the three streams from their last entries (seen before
the group reads, so that nothing added in between is missed). XREAD delivers nothing to
the group: whatever wakes it is taken by the group reads that follow, by whichever unit
gets there first, so a unit never receives more than it has room for. Retries waiting for
their backoff sit in a sorted set and are moved to their stream when due, by any unit.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from typing import Any

from redis.exceptions import RedisError, ResponseError

from services.jobs.broker import QueueUnavailable
from services.jobs.records import LEVELS, Delivery, Outcome, trace_carrier, valid_id
from services.jobs.redis_errors import is_outage

log = logging.getLogger("onecard.jobs")


def _s(v: Any) -> str:
    # bytes that are no UTF-8 (a record edited by hand) read as U+FFFD: they made the job a 500
    # and hid its model's whole listing behind "not a cursor this API gave"
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def deadline(method):
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
        except (RedisError, OSError) as exc:
            if isinstance(exc, ResponseError) and not is_outage(exc):
                raise  # a wrong command or script is a bug, not an outage
            raise QueueUnavailable(str(exc)) from exc
    return bounded


class RedisConsuming:
    """Mixed into RedisBroker: uses its connections, keys and scripts."""

    async def _promote_due(self, label: str) -> float | None:
        """Move due retries to their level's stream; seconds until the next one is due."""
        key, now_ms = self.delayed_key(label), int(self.clock() * 1000)
        async with self.r.pipeline(transaction=False) as pipe:
            due, first = await pipe.zrangebyscore(key, "-inf", now_ms, start=0, num=100) \
                .zrange(key, 0, 0, withscores=True).execute()
        for member in due:
            level, _, job_id = _s(member).partition(":")
            if level in LEVELS and valid_id(job_id):
                await self._call("PROMOTE", {"job": self.job_key(job_id), "delayed": key,
                                             "stream": self.stream(label, level)},
                                 {"member": _s(member), "job_id": job_id, "now": repr(self.clock())})
            else:
                await self.r.zrem(key, member)
        if due:
            first = await self.r.zrange(key, 0, 0, withscores=True)
        return max(0.0, first[0][1] / 1000 - self.clock()) if first else None

    async def _create_groups(self, label: str) -> None:
        for stream in self.streams(label):
            try:
                await self.r.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _group_read(self, label: str, count: int) -> list[tuple[str, str, dict]]:
        """Up to ``count`` new entries, the highest level first, without waiting."""
        out: list[tuple[str, str, dict]] = []
        for level in LEVELS:
            if len(out) >= count:
                break
            try:
                resp = await self.r.xreadgroup(self.group, self.consumer, {self.stream(label, level): ">"},
                                               count=count - len(out))
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._create_groups(label)  # Redis lost them (a restart without persistence)
                continue
            for _stream, entries in resp or []:
                out += [(level, _s(e), f) for e, f in entries]
        return out

    async def _reclaim(self, label: str, count: int) -> list[tuple[str, str, dict]]:
        """Entries idle past the visibility timeout (their unit died or stalled), taken over.
        Not those this unit still runs: after a Redis outage longer than the timeout (no
        renewal got through) it took its own running job over, started it again with a new
        lease and dropped the first run's finished result. Claimed by the same consumer, such
        an entry is only renewed."""
        now = time.monotonic()
        if now < self._next_reclaim.get(label, 0.0):
            return []
        self._next_reclaim[label] = now + self.reclaim_period_s
        out: list[tuple[str, str, dict]] = []
        for level in LEVELS:
            stream = self.stream(label, level)
            try:
                cursor, entries, *_ = await self.r.xautoclaim(stream, self.group, self.consumer, self.visibility_ms,
                                                               start_id=self._cursor.get(stream, "0-0"),
                                                               count=count - len(out))
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            self._cursor[stream] = _s(cursor)
            out += [(level, _s(e), f) for e, f in entries
                    if f is not None and (stream, _s(e)) not in self._running_entries]
            if len(out) >= count:
                break
        if out:
            log.info("jobs: took over %d job(s) idle for over %.1f s on %s", len(out),
                     self.settings.visibility_timeout_s, label)
        return out

    async def _read(self, label: str, count: int, block_s: float) -> list[tuple[str, str, dict]]:
        streams = self.streams(label)
        async with self.r.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xrevrange(stream, count=1)
            last = [(_s(r[0][0]) if r else "0-0") for r in await pipe.execute()]
        got = await self._group_read(label, count)
        if got:
            return got
        next_due = await self._promote_due(label)
        wait = min(block_s, self.block_s, next_due if next_due is not None else block_s)
        if wait > 0:
            await self.blocking.xread(dict(zip(streams, last, strict=False)), count=1, block=max(1, int(wait * 1000)))
        if next_due is not None:
            await self._promote_due(label)
        return await self._group_read(label, count)

    @deadline
    async def take(self, label: str, count: int, block_s: float) -> list[Delivery]:
        await self._promote_due(label)
        entries = await self._reclaim(label, count) or await self._read(label, count, block_s)
        out: list[Delivery] = []
        try:
            for level, entry, fields in entries:
                d = await self._start(label, level, entry, fields)
                if d is not None:
                    self._running_entries.add((self.stream(label, level), entry))
                    out.append(d)
        except BaseException:
            # the runs this batch started are never run here: others (and this unit) take them
            # over after the visibility timeout, as before there was a set to keep them from it
            for d in out:
                self._ended(d)
            raise
        return out

    async def _start(self, label: str, level: str, entry: str, fields: dict) -> Delivery | None:
        """One taken entry started as this unit's run (a lease of its own), or None: not a job
        entry (discarded), not to run (its record says so), or its attempts spent (buried)."""
        stream = self.stream(label, level)
        job_id = _s(fields.get(b"id", b""))
        if not valid_id(job_id):
            keys = {"stream": stream, "dead": self.dead_stream(label), "stats": self.stats_key}
            await self._call("DISCARD", keys,
                             {"group": self.group, "entry": entry, "reason": "not a job entry",
                              "now": repr(self.clock()), "dead_maxlen": self.settings.dead_letter_maxlen,
                              "label": label})
            log.warning("jobs: discarded a malformed entry %s on %s", entry, stream)
            return None
        lease = os.urandom(8).hex()
        res = await self._call("START", {"stream": stream, **self.job_keys(job_id, label)},
                               {"group": self.group, "entry": entry, "node": self.node, "consumer": self.consumer,
                                "lease": lease, **self.job_args(job_id, label)})
        if _s(res[0]) != "run":
            if _s(res[0]) == "dead":
                log.warning("jobs: %s has no body; dead-lettered", job_id)
            return None
        attempts = int(_s(res[1]))
        queued_at = float(_s(res[3])) if res[3] else None
        d = Delivery(job_id, label, _s(res[2]), res[4], attempts + 1, entry, queued_at, self.clock(), lease, level,
                     _s(res[5]) == "1", int(_s(res[6])), trace_carrier(*map(_s, res[8:10])))
        if self.policy.exhausted(attempts):  # its last run was lost with its unit, running alone
            await self._call("BURY", {"stream": stream, **self.job_keys(job_id, label)},
                             {"group": self.group, "entry": entry, "lease": lease, "error": json.dumps(
                                 {"code": "attempts_exhausted", "message": "no run finished"}),
                              **self.job_args(job_id, label)})
            log.warning("jobs: %s was lost with its unit %d times running alone; dead-lettered", job_id, attempts)
            return None
        return d

    @deadline
    async def renew(self, label: str, deliveries: list[Delivery]) -> dict[str, str]:
        if not deliveries:
            return {}
        keys = [k for d in deliveries for k in (self.job_key(d.job_id), self.stream(label, d.level))]
        args = [a for d in deliveries for a in (d.entry, d.lease)]
        flags = await self._call("RENEW", {}, {"group": self.group, "consumer": self.consumer},
                                 extra_keys=keys, extra_args=args)
        names = {"1": "cancel", "lost": "lost"}
        verdicts = {d.job_id: names.get(_s(flag), "ok") for d, flag in zip(deliveries, flags, strict=False)}
        for d in deliveries:
            if verdicts.get(d.job_id) == "lost":  # another unit's now
                self._ended(d)
        return verdicts

    def _ended(self, d: Delivery) -> None:
        self._running_entries.discard((self.stream(d.label, d.level), d.entry))

    def run_ended(self, d: Delivery) -> None:
        self._ended(d)

    @deadline
    async def mark_solo(self, d: Delivery) -> bool:
        return bool(await self._call("SOLO", {"job": self.job_key(d.job_id)}, {"lease": d.lease}))

    @deadline
    async def finish(self, d: Delivery, outcome: Outcome) -> str:
        res = await self._call(
            "FINISH", {"stream": self.stream(d.label, d.level), "result": self.result_key(d.job_id),
                       **self.job_keys(d.job_id, d.label)},
            {"group": self.group, "entry": d.entry, "lease": d.lease, "state": outcome.state,
             "has_result": outcome.result is not None, "result": outcome.result or b"",
             "result_json": outcome.result_json, "content_type": outcome.content_type or "",
             "status": outcome.status or "", "headers": json.dumps(outcome.headers),
             "error": json.dumps(outcome.error) if outcome.error else "", "dead_letter": outcome.dead_letter,
             "attempts": d.attempt, "node": self.node, "consumer": self.consumer, "cancel_channel": self.channel,
             **self.budget_args(), **self.job_args(d.job_id, d.label)})
        self._ended(d)
        return _s(res)

    @deadline
    async def requeue(self, d: Delivery, error: dict[str, Any] | None, charged: bool, isolate: bool = False) -> str:
        decision = self.policy.after_run(d.charged, charged)
        res = await self._call(
            "REQUEUE", {"stream": self.stream(d.label, d.level), "to_stream": self.stream(d.label, d.level),
                        "delayed": self.delayed_key(d.label), **self.job_keys(d.job_id, d.label)},
            {"group": self.group, "entry": d.entry, "lease": d.lease, "error": json.dumps(error) if error else "",
             "action": decision.action, "attempts": decision.attempts, "delay_ms": int(decision.delay_s * 1000),
             "isolate": isolate, "level": d.level, **self.job_args(d.job_id, d.label)})
        self._ended(d)
        return _s(res)

    @deadline
    async def stream_stats(self, labels: list[str]) -> list[dict[str, Any]]:
        pipe = self.r.pipeline(transaction=False)
        for label in labels:
            for stream in self.streams(label):
                pipe.xinfo_groups(stream)
                pipe.xlen(stream)
            pipe.hget(self.stats_key, f"dead:{label}")
            pipe.zcard(self.delayed_key(label))
        res = await pipe.execute(raise_on_error=False)
        per = 2 * len(LEVELS) + 2
        out = []
        for i, label in enumerate(labels):
            row = res[per * i: per * (i + 1)]
            lag = pending = 0
            levels = {}
            for j, level in enumerate(LEVELS):
                groups, length = row[2 * j], row[2 * j + 1]
                group = next((g for g in groups if _s(g.get("name")) == self.group), None) \
                    if isinstance(groups, list) else None
                length = length if isinstance(length, int) else 0
                p = int(group["pending"]) if group else 0
                g_lag = group.get("lag") if group else None
                level_lag = int(g_lag) if g_lag is not None else max(0, length - p)
                levels[level] = level_lag
                lag, pending = lag + level_lag, pending + p
            dead, delayed = row[-2], row[-1]
            out.append({"stream": self.stream(label), "model": label, "lag": lag, "lag_by_priority": levels,
                        "delayed": delayed if isinstance(delayed, int) else 0, "pending": pending,
                        "dead_lettered": int(dead) if isinstance(dead, (bytes, str, int)) else 0})
        return out

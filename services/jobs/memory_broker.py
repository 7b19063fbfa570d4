"""Embedded backend: jobs in this process's memory, fed to this unit's own services.

Same semantics as the Redis backend (states, leases, priority levels, retries after a
backoff, attempts, dead letters and their redrive, idempotency, result expiry), minus
durability: a restart forgets every job. Waiting consumers sleep on an asyncio.Condition;
expiry is one timer per finished job. Memory is bounded: queued jobs by max_queued_jobs per
model, the bodies of queued, running and dead-lettered jobs by max_queued_bytes, finished
jobs by max_finished_jobs and max_results_bytes, each counted with its record (the oldest
finished are forgotten first, as if they had expired), Idempotency-Keys by
max_idempotency_keys.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import heapq
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

from services.jobs.broker import Broker, IdempotencyMismatch, ModelInfo, QueueFull
from services.jobs.policy import RetryPolicy
from services.jobs.records import (
    CANCELLED,
    DEAD,
    FAILED,
    LEVELS,
    NORMAL,
    QUEUED,
    RUNNING,
    TERMINAL,
    Delivery,
    NewJob,
    Outcome,
    Submitted,
    error_doc,
    trace_carrier,
)
from services.jobs.result_spool import ResultSpool
from services.jobs.settings import QueueSettings

CURSOR_RE = re.compile(r"([0-9]+):[0-9a-f]{32}")
# what a finished job holds besides its result (its record's fields, its index entries, its
# expiry timer), counted against max_results_bytes with it: uncounted, 7 598 detect jobs of
# 100-byte results kept 92 MiB (12.4 kB each) and max_finished_jobs alone let 100 000 of them
# hold about 1.2 GB (helper-49)
RECORD_BYTES = 12 * 1024


class _Index:
    """The jobs of one model in one state, in the order they entered it (a sequence number
    each): a page after a cursor is a bisection, not a scan."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.ids: list[str] = []
        self.seq_of: dict[str, int] = {}

    def add(self, job_id: str, seq: int) -> None:
        self.remove(job_id)
        self.seqs.append(seq)  # sequence numbers only grow: appending keeps the order
        self.ids.append(job_id)
        self.seq_of[job_id] = seq

    def remove(self, job_id: str) -> None:
        seq = self.seq_of.pop(job_id, None)
        if seq is not None:
            i = bisect.bisect_left(self.seqs, seq)
            del self.seqs[i], self.ids[i]

    def page(self, after: int, limit: int) -> tuple[list[tuple[int, str]], bool]:
        i = bisect.bisect_right(self.seqs, after)
        return list(zip(self.seqs[i:i + limit], self.ids[i:i + limit], strict=False)), i + limit < len(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


class MemoryBroker(Broker):
    mode = "embedded"

    def __init__(self, settings: QueueSettings, node: str, max_queued: int, policy: RetryPolicy | None = None,
                 clock: Callable[[], float] = time.time):
        super().__init__(policy or RetryPolicy.from_settings(settings))
        self.settings, self.node, self.max_queued, self.clock = settings, node, max_queued, clock
        self.jobs: dict[str, dict[str, str]] = {}
        self.bodies: dict[str, bytes] = {}
        self.bodies_bytes = 0      # the bodies of queued, running and dead-lettered jobs
        self.spool = ResultSpool(settings.results_dir)  # finished results, as files
        self.idem: collections.OrderedDict[str, tuple[dict[str, str], float]] = collections.OrderedDict()
        self.queues: dict[tuple[str, str], collections.deque[tuple[str, str]]] = \
            collections.defaultdict(collections.deque)
        self.delayed: dict[str, list[tuple[float, int, str]]] = collections.defaultdict(list)
        self.index: dict[tuple[str, str], _Index] = collections.defaultdict(_Index)
        self.pending: dict[str, set[str]] = collections.defaultdict(set)
        self.dead: dict[str, collections.deque[dict[str, str]]] = {}
        self.dead_count: collections.Counter[str] = collections.Counter()
        self._models: dict[str, ModelInfo] = {}
        self._cond = asyncio.Condition()
        self._seq = 0
        self._timers: dict[str, asyncio.TimerHandle] = {}
        # id -> what it holds (its result and RECORD_BYTES), oldest first
        self.finished: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.results_bytes = 0

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "max_queued_bytes": self.settings.max_queued_bytes,
                "max_results_bytes": self.settings.max_results_bytes}

    # ---- helpers ------------------------------------------------------------------
    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _set_index(self, job: dict[str, str], state: str) -> None:
        label, job_id = job["model"], job["id"]
        for s in (QUEUED, RUNNING, FAILED, DEAD):
            self.index[(label, s)].remove(job_id)
        self.index[(label, state)].add(job_id, self._next())

    def _expire_later(self, job_id: str, ttl: float) -> None:
        old = self._timers.pop(job_id, None)
        if old is not None:
            old.cancel()
        self._timers[job_id] = asyncio.get_running_loop().call_later(ttl, self._forget, job_id)

    def _drop_body(self, job_id: str) -> None:
        self.bodies_bytes -= len(self.bodies.pop(job_id, b""))

    def _forget(self, job_id: str) -> None:
        timer = self._timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        self.results_bytes -= self.finished.pop(job_id, 0)
        job = self.jobs.pop(job_id, None)
        self._drop_body(job_id)
        self.spool.drop(job_id)
        if job is not None:
            for s in (*TERMINAL, DEAD):
                self.index[(job["model"], s)].remove(job_id)

    def _terminal(self, job: dict[str, str], state: str, error: dict[str, Any] | None = None,
                  keep_body: bool = False) -> None:
        job.update(state=state, finished_at=repr(self.clock()), progress="1", lease="")
        if error is not None:
            job["error"] = json.dumps(error)
        if not keep_body:
            self._drop_body(job["id"])
        self.pending[job["model"]].discard(job["id"])
        self._set_index(job, state)
        self._expire_later(job["id"], self.settings.results_ttl_s)
        size = (self.spool.size(job["id"]) or 0) + RECORD_BYTES
        self.finished[job["id"]] = size
        self.results_bytes += size
        # (never the job just finished: one result may take all of max_results_bytes, its record besides)
        while len(self.finished) > 1 and (len(self.finished) > self.settings.max_finished_jobs
                                          or self.results_bytes > self.settings.max_results_bytes):
            self._forget(next(iter(self.finished)))
        self._notify_done(job["id"])

    def _bury(self, job: dict[str, str], error: dict[str, Any] | None) -> None:
        """Failed and dead-lettered; the body stays with the record, for a redrive."""
        self._terminal(job, FAILED, error or error_doc("attempts_exhausted", "no run finished"), keep_body=True)
        job["dead"] = "1"
        self.index[(job["model"], DEAD)].add(job["id"], self._next())
        label = job["model"]
        q = self.dead.setdefault(label, collections.deque(maxlen=self.settings.dead_letter_maxlen))
        q.append({"id": job["id"], "error": job.get("error", ""), "at": repr(self.clock())})
        self.dead_count[label] += 1

    def _enqueue(self, job: dict[str, str], delay_s: float = 0.0) -> None:
        job.update(state=QUEUED, node="", consumer="", lease="", queued_at=repr(self.clock()), retry_at="")
        self._set_index(job, QUEUED)
        seq = self._next()
        if delay_s > 0:
            due = self.clock() + delay_s
            job.update(entry=f"d{seq}", retry_at=repr(due))
            heapq.heappush(self.delayed[job["model"]], (due, seq, job["id"]))
        else:
            job["entry"] = str(seq)
            self.queues[(job["model"], job.get("priority") or NORMAL)].append((job["id"], str(seq)))

    def _promote(self, label: str) -> float | None:
        """Move retries whose backoff is over to their level's queue; the next due time."""
        heap, now = self.delayed[label], self.clock()
        while heap and heap[0][0] <= now:
            _due, seq, job_id = heapq.heappop(heap)
            job = self.jobs.get(job_id)
            if job is not None and job["state"] == QUEUED and job.get("entry") == f"d{seq}":
                entry = str(self._next())
                job.update(entry=entry, retry_at="", queued_at=repr(now))
                self.queues[(label, job.get("priority") or NORMAL)].append((job_id, entry))
        return heap[0][0] if heap else None

    def _idem_get(self, key: str) -> dict[str, str] | None:
        found = self.idem.get(key)
        if found is None:
            return None
        if found[1] <= time.monotonic():
            del self.idem[key]
            return None
        return found[0]

    def _idem_put(self, key: str, value: dict[str, str]) -> None:
        self.idem[key] = (value, time.monotonic() + self.settings.idempotency_ttl_s)
        self.idem.move_to_end(key)
        while len(self.idem) > self.settings.max_idempotency_keys:
            self.idem.popitem(last=False)

    # ---- the API side -------------------------------------------------------------
    async def submit(self, job: NewJob, label: str) -> Submitted:
        if job.idempotency_key:
            known = self._idem_get(job.idempotency_key)
            if known is not None:
                if known["sha"] != job.request_sha:
                    raise IdempotencyMismatch(known["id"])
                rec = self.jobs.get(known["id"])
                return Submitted(known["id"], rec["state"] if rec else "expired", False, known["model"])
        if len(self.index[(label, QUEUED)]) >= self.max_queued:
            raise QueueFull(f"{self.max_queued} jobs are already waiting for {label}")
        if self.bodies_bytes + len(job.body) > self.settings.max_queued_bytes:
            raise QueueFull(f"the jobs waiting or running hold {self.bodies_bytes} bytes; this one would take "
                            f"them over queue.max_queued_bytes ({self.settings.max_queued_bytes})")
        fields = {"id": job.id, "service": job.service, "route": job.route, "model": label, "attempts": "0",
                  "runs": "0", "created_at": repr(job.created_at), "request_sha": job.request_sha, "progress": "0",
                  "priority": job.priority, **(job.trace or {})}
        self.jobs[job.id] = fields
        self.bodies[job.id] = job.body
        self.bodies_bytes += len(job.body)
        if job.idempotency_key:
            self._idem_put(job.idempotency_key, {"id": job.id, "sha": job.request_sha, "model": label})
        async with self._cond:
            self._enqueue(fields)
            self._cond.notify_all()
        return Submitted(job.id, QUEUED, True, label)

    async def get(self, job_id: str) -> dict[str, str] | None:
        job = self.jobs.get(job_id)
        return dict(job) if job else None

    async def result(self, job_id: str) -> bytes | None:
        size = self.spool.size(job_id)
        return None if size is None else await self.spool.chunk(job_id, 0, size)

    async def result_size(self, job_id: str) -> int | None:
        return self.spool.size(job_id)

    async def result_chunk(self, job_id: str, start: int, size: int) -> bytes:
        return await self.spool.chunk(job_id, start, size)

    async def close(self) -> None:
        self.spool.close()

    async def cancel(self, job_id: str) -> tuple[str, dict[str, str]] | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job["state"] in TERMINAL:
            return job["state"], dict(job)
        job["cancel"] = "1"
        if job["state"] == QUEUED:
            try:
                self.queues[(job["model"], job.get("priority") or NORMAL)].remove((job_id, job["entry"]))
            except ValueError:
                pass  # a retry waiting for its backoff: skipped when it comes due
            self._terminal(job, CANCELLED, error_doc("cancelled", "cancelled before it ran"))
            return CANCELLED, dict(job)
        self._notify_cancel(job_id)
        return "cancelling", dict(job)

    async def list_jobs(self, label: str, state: str, limit: int, cursor: str | None
                        ) -> tuple[list[dict[str, str]], str | None]:
        after = 0
        if cursor:  # "sequence:id", as the Redis backend's "score:id"
            m = CURSOR_RE.fullmatch(cursor)
            if m is None:
                raise ValueError("not a cursor of this queue")
            after = int(m.group(1))
        page, more = self.index[(label, state)].page(after, limit)
        jobs = [dict(self.jobs[i]) for _, i in page if i in self.jobs]
        return jobs, (f"{page[-1][0]}:{page[-1][1]}" if more and page else None)

    async def redrive(self, job_id: str) -> str:
        job = self.jobs.get(job_id)
        if job is None:
            return "missing"
        if job["state"] != FAILED or job.get("dead") != "1":
            return "not_dead"
        if job_id not in self.bodies:
            return "no_body"
        timer = self._timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        self.results_bytes -= self.finished.pop(job_id, 0)
        self.spool.drop(job_id)
        self.index[(job["model"], DEAD)].remove(job_id)
        job.update(dead="", attempts="0", error="", finished_at="", progress="0", cancel="",
                   redriven_at=repr(self.clock()))
        async with self._cond:
            self._enqueue(job)
            self._cond.notify_all()
        return "ok"

    async def models(self) -> dict[str, ModelInfo]:
        return dict(self._models)

    async def announce(self, info: ModelInfo) -> bool:
        missing = info.label not in self._models
        self._models[info.label] = info
        return missing

    # ---- the consumer side --------------------------------------------------------
    def _start(self, label: str, level: str, job_id: str, entry: str) -> Delivery | None:
        job = self.jobs.get(job_id)
        if job is None or job.get("entry") != entry or job["state"] in TERMINAL:
            return None
        if job.get("cancel") == "1":
            self._terminal(job, CANCELLED, error_doc("cancelled", "cancelled before it ran"))
            return None
        if job_id not in self.bodies:
            self._bury(job, error_doc("body_missing", "the job has no body"))
            return None
        now, runs, lease = self.clock(), int(job.get("runs") or 0) + 1, os.urandom(8).hex()
        job.update(state=RUNNING, node=self.node, lease=lease, runs=str(runs), started_at=repr(now), solo="0")
        self._set_index(job, RUNNING)
        self.pending[label].add(job_id)
        return Delivery(job_id, label, job["route"], self.bodies[job_id], int(job["attempts"]) + 1, entry,
                        float(job["queued_at"]), now, lease, level, job.get("isolate") == "1", runs,
                        trace_carrier(job.get("traceparent", ""), job.get("tracestate", "")))

    def _ready(self, label: str) -> bool:
        return any(self.queues[(label, level)] for level in LEVELS)

    async def take(self, label: str, count: int, block_s: float) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_s
        async with self._cond:
            while True:
                due = self._promote(label)
                if self._ready(label):
                    break
                wait = deadline - loop.time()
                if due is not None:
                    wait = min(wait, max(0.0, due - self.clock()) + 0.001)
                if wait <= 0:
                    return []
                try:
                    await asyncio.wait_for(self._cond.wait(), wait)
                except TimeoutError:
                    pass
            out: list[Delivery] = []
            for level in LEVELS:  # the highest level first; FIFO within a level
                q = self.queues[(label, level)]
                while q and len(out) < count:
                    d = self._start(label, level, *q.popleft())
                    if d is not None:
                        out.append(d)
            return out

    def _held(self, d: Delivery) -> dict[str, str] | None:
        job = self.jobs.get(d.job_id)
        return job if job is not None and job.get("lease") == d.lease and job["state"] == RUNNING else None

    async def renew(self, label: str, deliveries: list[Delivery]) -> dict[str, str]:
        out = {}
        for d in deliveries:
            job = self._held(d)
            out[d.job_id] = "lost" if job is None else "cancel" if job.get("cancel") == "1" else "ok"
        return out

    async def mark_solo(self, d: Delivery) -> bool:
        job = self._held(d)
        if job is not None:
            job["solo"] = "1"
        return job is not None

    async def finish(self, d: Delivery, outcome: Outcome) -> str:
        if (verdict := self._lease_verdict(d, "duplicate")) != "ok":
            return verdict
        if outcome.result is not None:
            await self.spool.put(d.job_id, outcome.result)  # written on a worker thread: others run meanwhile
            if (verdict := self._lease_verdict(d, "duplicate")) != "ok":
                self.spool.drop(d.job_id)
                return verdict
        job = self.jobs[d.job_id]
        job.update(result_type=outcome.content_type or "", result_status=str(outcome.status or ""),
                   result_headers=json.dumps(outcome.headers), result_json="1" if outcome.result_json else "0",
                   attempts=str(d.attempt), node=self.node)
        if outcome.dead_letter and outcome.state == FAILED:
            self._bury(job, outcome.error)
        else:
            self._terminal(job, outcome.state, outcome.error)
        return "ok"

    def _lease_verdict(self, d: Delivery, terminal: str) -> str:
        """"ok" while the delivery's run still holds its job; else why not ("gone", `terminal`
        for a job already ended, "lost" for a lease taken over)."""
        job = self.jobs.get(d.job_id)
        if job is None:
            return "gone"
        if job["state"] in TERMINAL:
            return terminal
        if job.get("lease") != d.lease:
            return "lost"
        return "ok"

    async def requeue(self, d: Delivery, error: dict[str, Any] | None, charged: bool,
                      isolate: bool = False) -> str:
        if (verdict := self._lease_verdict(d, "done")) != "ok":
            return verdict
        job = self.jobs[d.job_id]
        self.pending[d.label].discard(d.job_id)
        if error is not None:
            job["last_error"] = json.dumps(error)
        decision = self.policy.after_run(d.charged, charged)
        job["attempts"] = str(decision.attempts)
        if isolate:
            job["isolate"] = "1"
        if job.get("cancel") == "1":
            self._terminal(job, CANCELLED, error_doc("cancelled", "cancelled while it ran"))
            return "cancelled"
        if decision.action == "dead":
            last = json.loads(job["last_error"]) if job.get("last_error") else None
            self._bury(job, last)
            return "dead"
        async with self._cond:
            self._enqueue(job, decision.delay_s)
            self._cond.notify_all()
        return "requeued"

    async def stream_stats(self, labels: list[str]) -> list[dict[str, Any]]:
        return [{"stream": label, "model": label, "lag": sum(len(self.queues[(label, lv)]) for lv in LEVELS),
                 "delayed": len(self.delayed[label]), "pending": len(self.pending[label]),
                 "dead_lettered": self.dead_count[label]} for label in labels]

"""Embedded backend: jobs in this process's memory, fed to this unit's own services.

Same semantics as the Redis backend (states, attempts, dead letters, idempotency, result
expiry), minus durability: a restart forgets every job. Waiting consumers sleep on an
asyncio.Condition; expiry is one timer per finished job. Memory is bounded: queued jobs by
max_queued_jobs per model, finished ones by max_finished_jobs and max_results_bytes (the
oldest finished are forgotten first, as if they had expired).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any, Callable

from services.jobs.broker import Broker, IdempotencyMismatch, ModelInfo, QueueFull, Submitted
from services.jobs.records import (CANCELLED, FAILED, QUEUED, RUNNING, TERMINAL, Delivery, NewJob, Outcome,
                                   error_doc)
from services.jobs.settings import QueueSettings


class MemoryBroker(Broker):
    mode = "embedded"

    def __init__(self, settings: QueueSettings, node: str, max_queued: int, clock: Callable[[], float] = time.time):
        super().__init__()
        self.settings, self.node, self.max_queued, self.clock = settings, node, max_queued, clock
        self.jobs: dict[str, dict[str, str]] = {}
        self.bodies: dict[str, bytes] = {}
        self.bodies_bytes = 0      # the bodies of queued and running jobs
        self.results: dict[str, bytes] = {}
        self.idem: dict[str, str] = {}
        self.queues: dict[str, collections.deque[tuple[str, str]]] = collections.defaultdict(collections.deque)
        self.pending: dict[str, set[str]] = collections.defaultdict(set)
        self.dead: dict[str, collections.deque[dict[str, str]]] = {}
        self.dead_count: collections.Counter[str] = collections.Counter()
        self._models: dict[str, ModelInfo] = {}
        self._cond = asyncio.Condition()
        self._seq = 0
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.finished: collections.OrderedDict[str, int] = collections.OrderedDict()  # id -> result bytes, oldest first
        self.results_bytes = 0

    # ---- helpers ------------------------------------------------------------------
    def _entry(self) -> str:
        self._seq += 1
        return str(self._seq)

    def _expire_later(self, job_id: str, ttl: float) -> None:
        old = self._timers.pop(job_id, None)
        if old is not None:
            old.cancel()
        self._timers[job_id] = asyncio.get_running_loop().call_later(ttl, self._forget, job_id)

    def _forget(self, job_id: str) -> None:
        timer = self._timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        self.results_bytes -= self.finished.pop(job_id, 0)
        job = self.jobs.pop(job_id, None)
        self.bodies_bytes -= len(self.bodies.pop(job_id, b""))
        self.results.pop(job_id, None)
        if job and job.get("idem") and self.idem.get(job["idem"]) == job_id:
            del self.idem[job["idem"]]

    def _terminal(self, job: dict[str, str], state: str, error: dict[str, Any] | None = None) -> None:
        job.update(state=state, finished_at=repr(self.clock()), progress="1")
        if error is not None:
            job["error"] = json.dumps(error)
        self.bodies_bytes -= len(self.bodies.pop(job["id"], b""))
        self._expire_later(job["id"], self.settings.results_ttl_s)
        size = len(self.results.get(job["id"], b""))
        self.finished[job["id"]] = size
        self.results_bytes += size
        while self.finished and (len(self.finished) > self.settings.max_finished_jobs
                                 or self.results_bytes > self.settings.max_results_bytes):
            self._forget(next(iter(self.finished)))
        self._notify_done(job["id"])

    def _dead_letter(self, label: str, job: dict[str, str]) -> None:
        q = self.dead.setdefault(label, collections.deque(maxlen=self.settings.dead_letter_maxlen))
        q.append({"id": job["id"], "error": job.get("error", ""), "at": repr(self.clock())})
        self.dead_count[label] += 1

    def _enqueue(self, label: str, job: dict[str, str]) -> None:
        entry = self._entry()
        job.update(state=QUEUED, entry=entry, node="", queued_at=repr(self.clock()))
        self.queues[label].append((job["id"], entry))

    # ---- the API side -------------------------------------------------------------
    async def submit(self, job: NewJob, label: str) -> Submitted:
        if job.idempotency_key:
            known = self.idem.get(job.idempotency_key)
            if known is not None and known in self.jobs:
                if self.jobs[known].get("request_sha") != job.request_sha:
                    raise IdempotencyMismatch(known)
                return Submitted(known, self.jobs[known]["state"], False)
        if len(self.queues[label]) >= self.max_queued:
            raise QueueFull(f"{self.max_queued} jobs are already waiting for {label}")
        if self.bodies_bytes + len(job.body) > self.settings.max_queued_bytes:
            raise QueueFull(f"the jobs waiting or running hold {self.bodies_bytes} bytes; this one would take "
                            f"them over queue.max_queued_bytes ({self.settings.max_queued_bytes})")
        fields = {"id": job.id, "service": job.service, "route": job.route, "model": label, "attempts": "0",
                  "created_at": repr(job.created_at), "request_sha": job.request_sha, "progress": "0",
                  "idem": job.idempotency_key or ""}
        self.jobs[job.id] = fields
        self.bodies[job.id] = job.body
        self.bodies_bytes += len(job.body)
        if job.idempotency_key:
            self.idem[job.idempotency_key] = job.id
        async with self._cond:
            self._enqueue(label, fields)
            self._cond.notify_all()
        return Submitted(job.id, QUEUED, True)

    async def get(self, job_id: str) -> dict[str, str] | None:
        job = self.jobs.get(job_id)
        return dict(job) if job else None

    async def result(self, job_id: str) -> bytes | None:
        return self.results.get(job_id)

    async def cancel(self, job_id: str) -> tuple[str, dict[str, str]] | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job["state"] in TERMINAL:
            return job["state"], dict(job)
        job["cancel"] = "1"
        if job["state"] == QUEUED:
            q = self.queues[job["model"]]
            try:
                q.remove((job_id, job["entry"]))
            except ValueError:
                pass
            self._terminal(job, CANCELLED, error_doc("cancelled", "cancelled before it ran"))
            return CANCELLED, dict(job)
        self._notify_cancel(job_id)
        return "cancelling", dict(job)

    async def models(self) -> dict[str, ModelInfo]:
        return dict(self._models)

    async def announce(self, info: ModelInfo) -> None:
        self._models[info.label] = info

    # ---- the consumer side --------------------------------------------------------
    def _start(self, label: str, job_id: str, entry: str) -> Delivery | None:
        job = self.jobs.get(job_id)
        if job is None or job.get("entry") != entry or job["state"] in TERMINAL:
            return None
        if job.get("cancel") == "1":
            self._terminal(job, CANCELLED, error_doc("cancelled", "cancelled before it ran"))
            return None
        attempts = int(job["attempts"])
        if attempts >= self.settings.max_attempts:
            last = json.loads(job["last_error"]) if job.get("last_error") else None
            self._terminal(job, FAILED, last or error_doc("attempts_exhausted", "no run finished"))
            self._dead_letter(label, job)
            return None
        now = self.clock()
        job.update(state=RUNNING, node=self.node, attempts=str(attempts + 1), started_at=repr(now))
        self.pending[label].add(job_id)
        return Delivery(job_id, label, job["route"], self.bodies[job_id], attempts + 1, entry,
                        float(job["queued_at"]), now)

    async def take(self, label: str, count: int, block_s: float) -> list[Delivery]:
        q = self.queues[label]
        async with self._cond:
            if not q:
                try:
                    await asyncio.wait_for(self._cond.wait_for(lambda: bool(q)), block_s)
                except asyncio.TimeoutError:
                    return []
            out = []
            while q and len(out) < count:
                d = self._start(label, *q.popleft())
                if d is not None:
                    out.append(d)
            return out

    async def renew(self, label: str, deliveries: list[Delivery]) -> set[str]:
        return {d.job_id for d in deliveries if self.jobs.get(d.job_id, {}).get("cancel") == "1"}

    async def finish(self, d: Delivery, outcome: Outcome) -> bool:
        self.pending[d.label].discard(d.job_id)
        job = self.jobs.get(d.job_id)
        if job is None or job["state"] in TERMINAL:
            return False
        job.update(result_type=outcome.content_type or "", result_status=str(outcome.status or ""),
                   result_headers=json.dumps(outcome.headers))
        if outcome.result is not None:
            self.results[d.job_id] = outcome.result
        self._terminal(job, outcome.state, outcome.error)
        if outcome.dead_letter:
            self._dead_letter(d.label, job)
        return True

    async def requeue(self, d: Delivery, error: dict[str, Any] | None, counted: bool) -> str:
        self.pending[d.label].discard(d.job_id)
        job = self.jobs.get(d.job_id)
        if job is None or job["state"] in TERMINAL:
            return "done"
        if job.get("entry") != d.entry:
            return "done"  # someone else re-queued it already
        if error is not None:
            job["last_error"] = json.dumps(error)
        if job.get("cancel") == "1":
            self._terminal(job, CANCELLED, error_doc("cancelled", "cancelled while it ran"))
            return "cancelled"
        attempts = int(job["attempts"]) - (0 if counted else 1)
        job["attempts"] = str(attempts)
        if attempts >= self.settings.max_attempts:
            self._terminal(job, FAILED, error or error_doc("attempts_exhausted", "no run finished"))
            self._dead_letter(d.label, job)
            return "dead"
        async with self._cond:
            self._enqueue(d.label, job)
            self._cond.notify_all()
        return "requeued"

    async def stream_stats(self, labels: list[str]) -> list[dict[str, Any]]:
        return [{"stream": label, "model": label, "lag": len(self.queues[label]),
                 "pending": len(self.pending[label]), "dead_lettered": self.dead_count[label]} for label in labels]

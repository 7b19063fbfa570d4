"""What the jobs API and the consumers need from a queue backend.

Two backends implement it with the same semantics: ``MemoryBroker`` (embedded: one
process, nothing to install) and ``RedisBroker`` (Redis Streams: many units). A job's
state moves only through these calls, each atomic in its backend:

    submit -> queued -> take -> running -> finish -> succeeded | failed | cancelled
                ^                  |                            |
                +---- requeue -----+  a failed attempt (after   |
                |                     its backoff), a hand-back |
                +------------ redrive (dead-lettered) ----------+

``take`` turns a queued job into a running one with a new lease (or skips it: cancelled,
expired, already done). Every write of a run (renew, finish, requeue) shows its lease: a
run whose job was taken over (its unit stalled past the visibility timeout) can no longer
write, so a job has exactly one result, written by the run the record names. What a run's
end means for the job (retry after a backoff, dead-letter) is decided by policy.py.
"""

from __future__ import annotations

import abc
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.jobs.policy import RetryPolicy
from services.jobs.records import Delivery, NewJob, Outcome, Submitted


class QueueUnavailable(Exception):
    """The queue backend cannot be reached now (Redis down or restarting)."""


class QueueFull(Exception):
    """Too many jobs are queued for this model, or the queue has no room for this one."""


class JobTooLarge(QueueFull):
    """The job alone (its body and the room for its result) is over the queue's whole budget."""


class QueueRefusesWrites(QueueUnavailable):
    """The queue answers but refuses writes (Redis at its maxmemory, a read-only replica)."""


class IdempotencyMismatch(Exception):
    """An Idempotency-Key reused with a different request."""


def numeric_limits(limits: Any) -> dict[str, int | float]:
    """The finite numbers of a limits table from a service's /info or another unit's entry in
    Redis: anything else (a string, a boolean, inf) would make every submit of that model a 500."""
    if not isinstance(limits, dict):
        return {}
    return {str(k): v for k, v in limits.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


@dataclass
class ModelInfo:
    label: str
    service: str
    routes: list[str] | None = None            # None: no unit has announced the model yet
    limits: dict[str, Any] = field(default_factory=dict)
    control_routes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "service": self.service, "routes": self.routes, "limits": self.limits,
                "control_routes": self.control_routes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ModelInfo:
        routes, control = doc.get("routes"), doc.get("control_routes")
        return cls(str(doc["label"]), str(doc["service"]),
                   [str(r) for r in routes] if isinstance(routes, list) else None, numeric_limits(doc.get("limits")),
                   [str(r) for r in control] if isinstance(control, list) else [])


class Broker(abc.ABC):
    mode: str

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.refusal: str | None = None          # why the backend refused the last write, if it did
        self.refusals: collections.Counter[str] = collections.Counter()
        self._cancel_listener: Callable[[str], None] | None = None
        self._done_listener: Callable[[str], None] | None = None

    def on_cancel(self, listener: Callable[[str], None]) -> None:
        """``listener(job_id)`` runs when a running job must stop (cancelled, or done elsewhere)."""
        self._cancel_listener = listener

    def _notify_cancel(self, job_id: str) -> None:
        if self._cancel_listener is not None:
            self._cancel_listener(job_id)

    def on_done(self, listener: Callable[[str], None]) -> None:
        """``listener(job_id)`` runs when a job reaches a terminal state (on any unit)."""
        self._done_listener = listener

    def _notify_done(self, job_id: str) -> None:
        if self._done_listener is not None:
            self._done_listener(job_id)

    # ---- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:  # noqa: B027 - optional: a broker in memory has nothing to connect
        """Connect; raises QueueUnavailable when the backend cannot be reached."""

    async def close(self) -> None:  # noqa: B027 - optional: a broker in memory holds no connection
        """Release connections."""

    async def ping(self) -> bool:
        return True

    async def refuses_writes(self) -> str | None:
        """Why the backend refuses writes now (a full or read-only Redis), or None."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode}

    # ---- the API side -------------------------------------------------------------
    @abc.abstractmethod
    async def submit(self, job: NewJob, label: str) -> Submitted: ...

    @abc.abstractmethod
    async def get(self, job_id: str) -> dict[str, str] | None: ...

    @abc.abstractmethod
    async def result(self, job_id: str) -> bytes | None:
        """The whole result (small ones; big ones are read with result_chunk)."""

    @abc.abstractmethod
    async def result_size(self, job_id: str) -> int | None: ...

    @abc.abstractmethod
    async def result_chunk(self, job_id: str, start: int, size: int) -> bytes:
        """``size`` bytes of the result from ``start`` (fewer at its end; none once it expired)."""

    @abc.abstractmethod
    async def cancel(self, job_id: str) -> tuple[str, dict[str, str]] | None:
        """(verdict, the job's fields): 'cancelled' (it was queued), 'cancelling' (it runs: the
        unit running it is told), or the terminal state it already had. None: no such job."""

    @abc.abstractmethod
    async def list_jobs(self, label: str, state: str, limit: int, cursor: str | None
                        ) -> tuple[list[dict[str, str]], str | None]:
        """A page of a model's jobs in a state (or 'dead'), oldest first by when they entered
        it, and the cursor of the next page (None: no more). A page may hold fewer than
        ``limit`` jobs while more follow: records that expired meanwhile are skipped."""

    @abc.abstractmethod
    async def redrive(self, job_id: str) -> str:
        """A dead-lettered job back on its queue: 'ok', 'missing', 'not_dead', 'no_body'
        (expired), or 'nomem' (the queue has no room for it now)."""

    @abc.abstractmethod
    async def models(self) -> dict[str, ModelInfo]: ...

    @abc.abstractmethod
    async def announce(self, info: ModelInfo) -> bool:
        """Put the model's entry in the registry (again); True when it was missing."""

    async def epoch(self) -> str | None:
        """The queue's data marker (created when missing): another value than before means
        the backend lost its data. None where the queue lives in this process."""
        return None

    # ---- the consumer side --------------------------------------------------------
    @abc.abstractmethod
    async def take(self, label: str, count: int, block_s: float) -> list[Delivery]:
        """Up to ``count`` runnable jobs of this model, the highest priority level first,
        waiting at most ``block_s`` for one."""

    @abc.abstractmethod
    async def renew(self, label: str, deliveries: list[Delivery]) -> dict[str, str]:
        """Keep running jobs ours (visibility). Per job id: 'ok', 'cancel' (a cancel was
        requested) or 'lost' (another run holds the job now: stop, write nothing)."""

    def run_ended(self, d: Delivery) -> None:  # noqa: B027 - optional: only a shared queue takes runs over
        """The consumer is done with this run, however it ended (written, handed back, lost, or
        given up on): a run this unit no longer runs may be taken over again, by it too."""

    @abc.abstractmethod
    async def mark_solo(self, d: Delivery) -> bool:
        """Record that this run is alone on its service (losing it is then charged to it)."""

    @abc.abstractmethod
    async def finish(self, d: Delivery, outcome: Outcome) -> str:
        """Store the outcome: 'ok'; 'duplicate' (it had one), 'lost' (another run holds the
        job), 'gone' (expired), 'no_room' (the result is over what was reserved and the queue
        is full: the job failed instead)."""

    @abc.abstractmethod
    async def requeue(self, d: Delivery, error: dict[str, Any] | None, charged: bool,
                      isolate: bool = False) -> str:
        """The run did not finish the job: 'requeued' (at once, or after the policy's
        backoff), 'dead' (its attempts are spent), 'cancelled', or 'done'/'lost'/'gone'
        when it is not this run's to hand back."""

    @abc.abstractmethod
    async def stream_stats(self, labels: list[str]) -> list[dict[str, Any]]:
        """Per model: stream, lag, pending, dead_lettered."""

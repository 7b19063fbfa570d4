"""What the jobs API and the consumers need from a queue backend.

Two backends implement it with the same semantics: ``MemoryBroker`` (embedded: one
process, nothing to install) and ``RedisBroker`` (Redis Streams: many units). A job's
state moves only through these calls, each atomic in its backend:

    submit -> queued -> take -> running -> finish -> succeeded | failed | cancelled
                          ^                  |
                          +---- requeue -----+   (a failed attempt, or a job handed back)

``take`` turns a queued job into a running one (or skips it: cancelled, expired, already
done, or out of attempts: failed and dead-lettered). ``finish`` is idempotent: the first
terminal state wins, a second run's result is dropped, so a job has exactly one result.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from services.jobs.records import Delivery, NewJob, Outcome


class QueueUnavailable(Exception):
    """The queue backend cannot be reached now (Redis down or restarting)."""


class QueueFull(Exception):
    """Too many jobs are queued for this model."""


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
    def from_json(cls, doc: dict[str, Any]) -> "ModelInfo":
        routes, control = doc.get("routes"), doc.get("control_routes")
        return cls(str(doc["label"]), str(doc["service"]),
                   [str(r) for r in routes] if isinstance(routes, list) else None, numeric_limits(doc.get("limits")),
                   [str(r) for r in control] if isinstance(control, list) else [])


@dataclass
class Submitted:
    id: str
    state: str
    created: bool          # False: an Idempotency-Key replay of an earlier submit


class Broker(abc.ABC):
    mode: str

    def __init__(self) -> None:
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
    async def start(self) -> None:
        """Connect; raises QueueUnavailable when the backend cannot be reached."""

    async def close(self) -> None:
        """Release connections."""

    async def ping(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode}

    # ---- the API side -------------------------------------------------------------
    @abc.abstractmethod
    async def submit(self, job: NewJob, label: str) -> Submitted: ...

    @abc.abstractmethod
    async def get(self, job_id: str) -> dict[str, str] | None: ...

    @abc.abstractmethod
    async def result(self, job_id: str) -> bytes | None: ...

    async def read(self, job_id: str, with_result: bool) -> tuple[dict[str, str], bytes | None] | None:
        """The job's fields and, when it succeeded and asked for, its result."""
        fields = await self.get(job_id)
        if fields is None:
            return None
        return fields, (await self.result(job_id) if with_result and fields.get("state") == "succeeded" else None)

    @abc.abstractmethod
    async def cancel(self, job_id: str) -> tuple[str, dict[str, str]] | None:
        """(verdict, the job's fields): 'cancelled' (it was queued), 'cancelling' (it runs: the
        unit running it is told), or the terminal state it already had. None: no such job."""

    @abc.abstractmethod
    async def models(self) -> dict[str, ModelInfo]: ...

    @abc.abstractmethod
    async def announce(self, info: ModelInfo) -> None: ...

    # ---- the consumer side --------------------------------------------------------
    @abc.abstractmethod
    async def take(self, label: str, count: int, block_s: float) -> list[Delivery]:
        """Up to ``count`` runnable jobs of this model, waiting at most ``block_s`` for one."""

    @abc.abstractmethod
    async def renew(self, label: str, deliveries: list[Delivery]) -> set[str]:
        """Keep running jobs ours (visibility); returns the ids whose cancel was requested."""

    @abc.abstractmethod
    async def finish(self, d: Delivery, outcome: Outcome) -> bool:
        """Store the outcome; False when the job already had one (a duplicate run)."""

    @abc.abstractmethod
    async def requeue(self, d: Delivery, error: dict[str, Any] | None, counted: bool) -> str:
        """Put the job back ('requeued'), or fail it when its attempts are spent ('dead');
        'cancelled' or 'done' when it must not run again."""

    @abc.abstractmethod
    async def stream_stats(self, labels: list[str]) -> list[dict[str, Any]]:
        """Per model: stream, lag, pending, dead_lettered."""

"""Admission: a request gets a queue slot, or a 503, before anything is spent on it.

The check runs once a request's body has arrived (its bytes are charged to the memory
ledger as they come, which bounds what uploads still arriving hold), before anything is
decoded, and the slot is counted at once: a burst cannot pass the check together. Uploads
that trickle therefore hold no slot: they cannot lock other clients out with 503s.
``max_queue`` bounds every admitted request that is not on the model yet, decoding or
waiting. ``max_queue = 0`` means no waiting at all: a request is admitted only when the
model is idle and nobody else is admitted.
"""

from __future__ import annotations

from services.runtime.errors import ApiError


class Ticket:
    """One admitted request's slot: waiting until it starts on the model, then running."""

    __slots__ = ("_admission", "state")

    def __init__(self, admission: Admission):
        self._admission = admission
        self.state = "waiting"

    def started(self) -> None:
        if self.state == "waiting":
            self.state = "running"
            self._admission.waiting -= 1
            self._admission.running += 1

    def release(self) -> None:
        if self.state == "waiting":
            self._admission.waiting -= 1
        elif self.state == "running":
            self._admission.running -= 1
        self.state = "done"


class Admission:
    """Counts live in the event loop's thread only (no lock needed)."""

    def __init__(self, max_queue: int, retry_after_s: int):
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.waiting = 0
        self.running = 0
        self.refused = 0

    def admit(self) -> Ticket:
        limit = self.max_queue if self.max_queue > 0 else (1 if self.running == 0 else 0)
        if self.waiting >= limit:
            self.refused += 1
            raise ApiError(503, "overloaded",
                           f"{self.waiting} requests are already waiting (max_queue {self.max_queue})",
                           {"Retry-After": str(self.retry_after_s)})
        self.waiting += 1
        return Ticket(self)

"""The service's memory, split into budgets that are checked before anything is spent.

    service budget = baseline (process after warm-up: model, runtime)
                   + one model call's working memory  (``batch_bytes``)
                   + what admitted requests hold       (``held_bytes``: bodies, decoded
                     pictures, results, encoded answers until the client has read them)

On a GPU the model call's working memory is on the card (the planned GPU budget minus the
weights); on the CPU it comes out of the same host budget. A request that could never fit
(one of its items is over a call's working memory, or what it would hold is over
``request_bytes``) is refused with 413 and the figures; one that fits but finds the held
budget taken by others gets 503 with Retry-After. The ledger is thread-safe: decode hooks
charge it from the CPU pool.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common import hostmemory as memory
from services.runtime.errors import ApiError

MIN_AVAILABLE = 64 * 2**20  # below this a budget is a misconfiguration, not a plan
DEFAULT_SHARE = 0.3          # of the container's memory, when the supervisor planned none


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Budgets:
    service_bytes: int          # host memory this service may use in all
    baseline_bytes: int         # resident after load and warm-up
    batch_bytes: int            # working memory of one model call
    held_bytes: int             # what admitted requests may hold together
    request_bytes: int          # what one request may hold
    batch_on_gpu: bool = False
    source: str = ""

    def snapshot(self) -> dict[str, Any]:
        return {"service_bytes": self.service_bytes, "baseline_bytes": self.baseline_bytes,
                "batch_bytes": self.batch_bytes, "held_bytes": self.held_bytes,
                "request_bytes": self.request_bytes, "batch_on_gpu": self.batch_on_gpu, "source": self.source}


def service_memory(configured: int | None, fraction: float | None, environ=os.environ,
                   limit: int | None = None) -> tuple[int | None, str]:
    """(bytes, where the figure comes from): the setting, else the supervisor's plan, else a
    share of the container's limit (or of the machine's RAM)."""
    if configured:
        return configured, "memory_budget_bytes"
    planned = environ.get("ONECARD_MEMORY_BUDGET_BYTES", "").strip()
    if planned.isdigit() and int(planned) > 0:
        return int(planned), "the supervisor's plan"
    limit = limit if limit is not None else memory.memory_limit()
    if not limit:
        return None, "unknown"
    share = fraction if fraction is not None else DEFAULT_SHARE
    return int(limit * share), f"{share:g} of the memory limit {mib(limit)}"


def plan_budgets(service_bytes: int | None, baseline: int, *, source: str = "",
                 batch_bytes: int | None = None, request_bytes: int | None = None,
                 gpu_batch_bytes: int | None = None) -> Budgets:
    """Split the service's memory. Explicit settings win; otherwise half of what is left
    after the baseline goes to one model call (on the CPU) and half to held requests, and a
    request may hold half of that."""
    if service_bytes is None:
        service_bytes = baseline + 4 * 2**30
        source = source or "no limit known: 4 GiB above the baseline"
    available = max(MIN_AVAILABLE, service_bytes - baseline)
    if gpu_batch_bytes is not None:
        batch = batch_bytes or gpu_batch_bytes
        held = available
    else:
        batch = batch_bytes or available // 2
        held = max(MIN_AVAILABLE // 2, available - batch)
    request = min(request_bytes or held // 2, held)
    return Budgets(service_bytes, baseline, batch, held, request, gpu_batch_bytes is not None, source)


class HeldMemory:
    """Bytes that admitted requests hold, against ``held_bytes``."""

    def __init__(self, limit: int, retry_after_s: int = 1):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.used = 0
        self.peak = 0
        self.refused = 0
        self._lock = threading.Lock()

    def resize(self, charge: Charge, new_bytes: int, what: str, force: bool = False) -> None:
        """Move one request's holding to `new_bytes`; raises 503 when the others leave no room
        (unless `force`: what is already there is counted, never refused)."""
        with self._lock:
            grow = new_bytes - charge.bytes
            if grow > 0 and not force and self.used + grow > self.limit:
                self.refused += 1
                raise ApiError(503, "memory_busy",
                               f"{what}: needs {mib(new_bytes)} while requests in progress hold "
                               f"{mib(self.used)} of {mib(self.limit)}; retry shortly",
                               {"Retry-After": str(self.retry_after_s)})
            self.used += grow
            self.peak = max(self.peak, self.used)
            charge.bytes = new_bytes

    def release(self, charge: Charge) -> None:
        with self._lock:
            self.used -= charge.bytes
            charge.bytes = 0


class Charge:
    """One request's holding in the ledger; `hold` grows or shrinks it, `close` ends it."""

    __slots__ = ("ledger", "bytes", "estimate", "closed", "on_close")

    def __init__(self, ledger: HeldMemory | None):
        self.ledger = ledger
        self.bytes = 0
        self.estimate: dict[str, Any] | None = None
        self.closed = False
        self.on_close: Callable[[], None] | None = None  # told when the request is over

    def hold(self, new_bytes: int, what: str = "this request") -> None:
        if self.ledger is not None and not self.closed:
            self.ledger.resize(self, max(0, int(new_bytes)), what)

    def account(self, new_bytes: int) -> None:
        """Count what the request holds now (its answer, already made): never a refusal."""
        if self.ledger is not None and not self.closed:
            self.ledger.resize(self, max(0, int(new_bytes)), "", force=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.ledger is not None:
                self.ledger.release(self)
            if self.on_close is not None:
                self.on_close()

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

import asyncio
import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.hostmemory import mib
from services.runtime.errors import ApiError

MIN_AVAILABLE = 64 * 2**20  # below this a budget is a misconfiguration, not a plan


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


def plan_budgets(service_bytes: int | None, baseline: int, *, source: str = "",
                 batch_bytes: int | None = None, request_bytes: int | None = None, held_bytes: int | None = None,
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
    held = held_bytes or held
    request = min(request_bytes or held // 2, held)
    return Budgets(service_bytes, baseline, batch, held, request, gpu_batch_bytes is not None, source)


class MemoryWait(Exception):  # noqa: N818 - a signal to the pipeline, not an error
    """A decode hook's request needs `bytes` that others hold now: the pipeline waits its turn
    for them (FIFO, bounded by the request's deadline) and decodes again."""

    def __init__(self, needed: int, what: str):
        super().__init__(f"{what}: waits for {mib(needed)}")
        self.needed, self.what = needed, what


class HeldMemory:
    """Bytes that admitted requests hold, against ``held_bytes``. A request that does not fit
    now waits in line (first come, first served: a smaller one behind it does not overtake)
    until enough is handed back, instead of being refused while others finish."""

    def __init__(self, limit: int, retry_after_s: int = 1):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.used = 0
        self.peak = 0
        self.refused = 0
        self.waited = 0
        self._lock = threading.Lock()
        self._line: collections.deque[tuple[Charge, int, asyncio.Future, asyncio.AbstractEventLoop]] = \
            collections.deque()

    def resize(self, charge: Charge, new_bytes: int, what: str, force: bool = False, wait: bool = False) -> None:
        """Move one request's holding to `new_bytes`. When the others leave no room (or others
        wait already): MemoryWait if the caller can wait, else 503. `force`: what is already
        there is counted, never refused."""
        with self._lock:
            grow = new_bytes - charge.bytes
            if grow > 0 and not force and (self.used + grow > self.limit or self._line):
                if wait:
                    raise MemoryWait(new_bytes, what)
                self.refused += 1
                raise self._busy(new_bytes, what)
            self._move(charge, new_bytes)
            if grow < 0:
                self._serve_line()

    def _busy(self, new_bytes: int, what: str) -> ApiError:
        return ApiError(503, "memory_busy", f"{what}: needs {mib(new_bytes)} while requests in progress hold "
                                            f"{mib(self.used)} of {mib(self.limit)}; retry shortly",
                        {"Retry-After": str(self.retry_after_s)})

    def _move(self, charge: Charge, new_bytes: int) -> None:
        self.used += new_bytes - charge.bytes
        self.peak = max(self.peak, self.used)
        charge.bytes = new_bytes

    async def wait_for(self, charge: Charge, new_bytes: int, what: str, timeout: float) -> None:
        """Hold `new_bytes` for `charge` once it is its turn and they fit; 503 after `timeout`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            self.waited += 1
            self._line.append((charge, new_bytes, future, loop))
            self._serve_line()
        try:
            await asyncio.wait_for(asyncio.shield(future), max(0.0, timeout))
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                granted = future.done() and not future.cancelled()
                self._line = collections.deque(w for w in self._line if w[2] is not future)
                if not granted:
                    future.cancel()
                    self._serve_line()  # it may have been the one holding the line up
            if isinstance(exc, asyncio.CancelledError):
                raise
            if not granted:
                self.refused += 1
                raise self._busy(new_bytes, what) from None

    def _serve_line(self) -> None:
        """Grant the waiters at the head of the line that fit now (called with the lock held).
        When everything held belongs to requests in the line (their bodies, read before they
        knew their full cost), nothing will ever be handed back: the head goes on anyway, over
        the budget by at most one request's cost, rather than every one of them waiting out its
        deadline."""
        while self._line:
            charge, new_bytes, future, loop = self._line[0]
            if future.done():
                self._line.popleft()
                continue
            stuck = self.used == sum(c.bytes for c, _, f, _ in self._line if not f.done())
            if self.used + new_bytes - charge.bytes > self.limit and not stuck:
                return
            self._line.popleft()
            self._move(charge, new_bytes)
            loop.call_soon_threadsafe(_grant, future)

    def release(self, charge: Charge) -> None:
        with self._lock:
            self.used -= charge.bytes
            charge.bytes = 0
            self._serve_line()


def _grant(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Charge:
    """One request's holding in the ledger; `hold` grows or shrinks it, `close` ends it."""

    __slots__ = ("ledger", "bytes", "estimate", "closed", "on_close")

    def __init__(self, ledger: HeldMemory | None):
        self.ledger = ledger
        self.bytes = 0
        self.estimate: dict[str, Any] | None = None
        self.closed = False
        self.on_close: Callable[[], None] | None = None  # told when the request is over

    def hold(self, new_bytes: int, what: str = "this request", wait: bool = False) -> None:
        """Grow or shrink the holding; `wait`: MemoryWait rather than 503 when others hold the room."""
        if self.ledger is not None and not self.closed:
            self.ledger.resize(self, max(0, int(new_bytes)), what, wait=wait)

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

"""Submits admitted against a memory bound before their bodies are read.

A submit holds its body, the parsed document and the body re-encoded for the service at
once: about three times its size. Each one takes that much of ``submit_memory_bytes``
(its Content-Length, or max_body_bytes when it sends none) once its first bytes are in,
before the rest of its body is read: 200 concurrent 30 MB submits cannot hold 200 bodies. One that
does not fit waits its turn (first come, first served: a small one does not overtake a big
one that came first) while its body waits in the client's socket, for at most
``submit_wait_s``; then 503 ``busy``. A burst of big submits is answered one by one
(each its own 202 or 4xx) instead of mostly 503s.

A submit takes its share once its body has begun (services.runtime.edge.body.body_begun):
200 clients reconnecting that asked for 100 Continue and sent nothing held the whole bound,
5 s each (the body rate's grace), and legitimate submits waited 27 s behind them (httpx's
default 5 s timeout: every one failed); now they hold a connection and no share (helper-58).
And it keeps its share only while its body arrives: a share whose body has brought nothing
for STALLED_S (counted from its last bytes, the wait in line included) gets 408
``body_stalled`` as soon as another submit waits for room, and gives its share back
(ArrivingBody). 200 clients that sent one byte of a 3 MB submit and stopped kept a
legitimate submit waiting 4.5 s in line behind them.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from services.runtime.edge.json_items import CLOSE
from services.runtime.errors import ApiError

HELD_PER_BODY_BYTE = 3
STALLED_S = 1.0   # a share's body that brings nothing this long while others wait is cut
LOOK_S = 0.25     # how often a body waited for looks whether others wait


class SubmitBudget:
    def __init__(self, total: int, retry_after_s: int, wait_s: float = 0.0):
        self.total, self.retry_after_s, self.wait_s = total, retry_after_s, wait_s
        self.used = 0
        self.waited = 0    # submits that waited for room
        self.refused = 0   # submits that waited in vain
        self._line: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for _, future in self._line if not future.done())

    def cost(self, declared: int | None, max_body_bytes: int) -> int:
        """What a body of `declared` bytes (its checked Content-Length; None: none) holds."""
        size = min(declared, max_body_bytes) if declared is not None else max_body_bytes
        return min(self.total, HELD_PER_BODY_BYTE * max(size, 1))

    async def take(self, n: int) -> Held:
        """Room for ``n`` bytes now, or once it is this submit's turn and they fit."""
        if not self._line and self.used + n <= self.total:
            self.used += n
            return Held(self, n)
        if self.wait_s <= 0:
            raise self._busy(n)
        future = asyncio.get_running_loop().create_future()
        self._line.append((n, future))
        self.waited += 1
        try:
            await asyncio.wait_for(asyncio.shield(future), self.wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():  # granted just as the wait ended
                self._give_back(n)
            else:
                future.cancel()
                self._line = collections.deque(w for w in self._line if w[1] is not future)
                self._serve_line()  # the next one may fit now that this one left the head
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.refused += 1
            raise self._busy(n) from None
        return Held(self, n)

    def _busy(self, n: int) -> ApiError:
        return ApiError(503, "busy", f"submits being read hold {self.used} of submit_memory_bytes "
                        f"({self.total}); this one needs {n}; retry shortly",
                        {"Retry-After": str(self.retry_after_s or 1), "Connection": "close"})

    def _give_back(self, n: int) -> None:
        self.used -= n
        self._serve_line()

    def _serve_line(self) -> None:
        while self._line:
            n, future = self._line[0]
            if future.done():
                self._line.popleft()
                continue
            if self.used + n > self.total:
                return
            self._line.popleft()
            self.used += n
            future.set_result(None)


class Held:
    def __init__(self, budget: SubmitBudget, n: int):
        self.budget, self.n = budget, n

    def release(self) -> None:
        if self.n:
            n, self.n = self.n, 0
            self.budget._give_back(n)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class StreamSlots(SubmitBudget):
    """Result pieces read and encoded at once (``max_result_streams``): a piece that finds them
    all taken waits its turn (first come, first served) for ``result_stream_wait_s`` instead of
    a 503 at once. A slot is held while a piece is read, never while its client is waited for
    (results.py): clients that never read held every slot until the send deadline cut them,
    and every other reader got 503 ``busy`` (helper-52, helper-53)."""

    def _busy(self, n: int) -> ApiError:
        return ApiError(503, "busy", f"{self.used} result pieces are being read (max_result_streams) and no slot came "
                        f"free for {self.wait_s:g} s (result_stream_wait_s); retry shortly",
                        {"Retry-After": str(self.retry_after_s or 1)})


class ArrivingBody:
    """The receive of a request holding a share of `budget`, starting with the messages that
    `arrived` before: once the body has brought nothing for STALLED_S since `last` (when its
    last bytes came), a body message waited for while others wait for room raises 408
    ``body_stalled`` (the share goes back as the request ends). Once the body is whole,
    receive is the request's own."""

    def __init__(self, receive: Callable[[], Awaitable[dict]], budget: SubmitBudget, arrived: list[dict],
                 last: float, stalled_s: float = STALLED_S, look_s: float = LOOK_S):
        self.inner, self.budget, self.last, self.stalled_s, self.look_s = receive, budget, last, stalled_s, look_s
        self.arrived = list(reversed(arrived))  # read before the share was taken (body_begun): given first
        self.whole = False

    async def __call__(self) -> dict:
        if self.arrived:
            return self._taken(self.arrived.pop())
        if self.whole:
            return await self.inner()
        loop = asyncio.get_running_loop()
        pending = asyncio.ensure_future(self.inner())
        try:
            while True:
                done, _ = await asyncio.wait((pending,), timeout=self.look_s)
                if done:
                    break
                if loop.time() - self.last >= self.stalled_s and self.budget.waiting:
                    raise ApiError(408, "body_stalled", f"the body brought nothing for {self.stalled_s:g} s while "
                                   "other submits waited for room in submit_memory_bytes", CLOSE)
        finally:
            if not pending.done():
                pending.cancel()
        self.last = loop.time()
        return self._taken(pending.result())

    def _taken(self, message: dict) -> dict:
        self.whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

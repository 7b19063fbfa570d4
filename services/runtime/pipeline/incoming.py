"""What is about to reach the queue, for the batching policy: requests still decoding, and
clients about to come back.

A request admitted and decoding will be queued when a decode usually ends. A closed-loop
client (one that sends its next request as soon as it has its answer, on the same kept-alive
connection: load generators, job consumers, most SDKs) will be queued again soon after its
answer is sent: the time between an answer and the next request on the same connection is
measured, and so is how often a connection does come back. When most do, every answer still
being encoded or sent is expected back at (its encode's usual end) + (the usual gap) + (a
decode). All times come from the caller (the scheduler's clock): tests replay them.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

EWMA = 0.2
RETURN_WITHIN_S = 2.0       # a connection that sends again within this came back
RETURNS_REMEMBERED = 64
RETURNING = 0.9             # the share of answers followed by a request that makes them count


class Incoming:
    def __init__(self) -> None:
        self._decoding: dict[object, float] = {}      # request -> when its decode started
        self._paused: dict[object, float] = {}        # request waiting for memory -> decode time so far
        self._answering: dict[object, float] = {}     # request -> when its encode started
        self.decode_s: float | None = None
        self.answer_s: float | None = None            # encode and send, usually
        self.gap_s: float | None = None               # answer sent -> next request on that connection
        self._sent: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._returns: collections.deque[tuple[float, bool]] = collections.deque(maxlen=RETURNS_REMEMBERED)

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else old + EWMA * (new - old)

    # ---- what the pipeline reports --------------------------------------------------------
    def arrived(self, connection: Hashable | None, now: float) -> None:
        """A request started on `connection`: did it come back after an answer?"""
        sent = self._sent.pop(connection, None) if connection is not None else None
        if sent is not None and now - sent <= RETURN_WITHIN_S:
            self.gap_s = self._mean(self.gap_s, now - sent)
            self._mark_returned(sent)

    def decoding(self, request: object, now: float) -> None:
        self._decoding[request] = now

    def decoded(self, request: object, now: float) -> None:
        started = self._decoding.pop(request, None)
        self._paused.pop(request, None)
        if started is not None:
            self.decode_s = self._mean(self.decode_s, now - started)

    def decode_paused(self, request: object, now: float) -> None:
        """The decode waits for memory that queued or running requests hold: it cannot reach the
        queue before they run, so it is not expected (waiting for it would wait for nothing until
        the cap: six requests in a 1 MiB budget took 10 s where 1.2 would do)."""
        started = self._decoding.pop(request, None)
        if started is not None:
            self._paused[request] = now - started

    def decode_resumed(self, request: object, now: float) -> None:
        """It has its memory and decodes again; the wait does not count as decode time."""
        spent = self._paused.pop(request, None)
        if spent is not None:
            self._decoding[request] = now - spent

    def answering(self, request: object, now: float) -> None:
        self._answering[request] = now

    def answered(self, request: object, connection: Hashable | None, now: float) -> None:
        started = self._answering.pop(request, None)
        if started is not None:
            self.answer_s = self._mean(self.answer_s, now - started)
        if connection is not None:
            self._sent[connection] = now
            self._sent.move_to_end(connection)
            while len(self._sent) > 4 * RETURNS_REMEMBERED:
                self._sent.popitem(last=False)
            self._returns.append((now, False))

    def _mark_returned(self, sent: float) -> None:
        for i in range(len(self._returns) - 1, -1, -1):
            at, returned = self._returns[i]
            if at == sent and not returned:
                self._returns[i] = (at, True)
                return

    # ---- what the policy asks -------------------------------------------------------------
    def returning_share(self, now: float) -> float | None:
        """How often an answer was followed by a request on its connection (answers old enough
        to know), or None before there are any."""
        known = [returned for at, returned in self._returns if returned or now - at > RETURN_WITHIN_S]
        return sum(known) / len(known) if len(known) >= 8 else None

    def etas(self, now: float) -> list[float]:
        """Seconds from now at which each coming item should be queued: requests decoding, and
        (when clients come back) answers in progress, then their connections' next requests."""
        decode = self.decode_s if self.decode_s is not None else 0.005
        out = [max(started + decode - now, 0.1 * decode) for started in self._decoding.values()]
        share = self.returning_share(now)
        if share is not None and share >= RETURNING and self.gap_s is not None and self._answering:
            answer = self.answer_s if self.answer_s is not None else 0.0
            out += [max(started + answer - now, 0.0) + self.gap_s + decode for started in self._answering.values()]
        return out

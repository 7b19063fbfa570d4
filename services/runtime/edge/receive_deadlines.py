"""What the client owes, by when, for the guarded protocol (protocol.py).

A head must arrive within ``header_timeout_s``, a body within ``body_timeout_s`` and at
``min_body_rate_bytes_s`` on average after ``body_rate_grace_s`` (body_pace); else 408 and a
close. A deadline runs only while the request is the client's to send: one pipelined behind
another gets its deadline when the earlier answers are out. It is never restarted by a byte
(uvicorn's keep-alive timer is, so a client trickling one byte at a time held a connection
forever: uvicorn issue 157).

A mixin: the protocol class sets ``edge_limits`` and ``edge_stats`` and provides its parser
state, ``_earlier_answers_pending`` and ``_fail``.
"""

from __future__ import annotations

import asyncio

from services.runtime.edge.admission import BODY, HEAD
from services.runtime.edge.body_pace import BodyRate
from services.runtime.edge.connection_limits import ConnectionLimits, ConnectionStats


class ReceiveDeadlines:
    edge_limits: ConnectionLimits
    edge_stats: type[ConnectionStats]
    _deadline: asyncio.TimerHandle | None = None
    _deadline_for: tuple[str, int] | None = None
    _body_rate: BodyRate | None = None

    def _update_receive_deadline(self) -> None:
        """Arm the deadline of what the client owes now, or none: a head or a body is
        the client's to send only once every earlier answer is out."""
        if self._broken or self.transport.is_closing():
            return
        limits = self.edge_limits
        if self._earlier_answers_pending():
            self._disarm()
        elif self._phase == BODY:
            self._arm(("body", self._message_no), limits.body_timeout_s)
            if self.cycle is not None and not self.cycle.response_complete:
                self._body_rate.start()
        elif self._phase == HEAD:
            self._arm(("head", self._message_no), limits.header_timeout_s)
        elif self._waiting_bytes > 0 or self._message_no == 0:
            # the first request's head is due from the connection; a later one's from its
            # first byte (until then uvicorn's keep-alive timer runs)
            self._arm(("head", self._message_no + 1), limits.header_timeout_s)
        else:
            self._disarm()

    def _arm(self, key: tuple[str, int], seconds: float) -> None:
        if self._deadline is not None and self._deadline_for == key:
            return  # already running for this head or body: never restarted by a byte
        self._disarm()
        self._deadline_for = key
        self._deadline = self.loop.call_later(seconds, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_for = None
        if self._body_rate is not None:
            self._body_rate.stop()

    def _client_waits(self) -> bool:
        """Is the body held back by us rather than by the client (reading paused until the
        app takes what arrived, or a 100 Continue not sent yet)?"""
        cycle = self.cycle
        return self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)

    def _on_body_too_slow(self) -> None:
        self.edge_stats.bodies_too_slow += 1
        self._cut_request(408, "body_too_slow",
                          f"the request body arrived at under {self.edge_limits.min_body_rate_bytes_s} bytes/s")

    def _on_deadline(self) -> None:
        self._deadline = None
        self.edge_stats.timed_out += 1
        self._cut_request(408, "request_timeout", "the request did not arrive in time")

    def _cut_request(self, status: int, code: str, message: str) -> None:
        self._cut = True
        self._broken = True
        self._disarm()
        if self._phase == BODY and self.cycle is not None and not self.cycle.response_complete:
            # the body did not arrive in time; the app sees a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._fail(status, code, message)

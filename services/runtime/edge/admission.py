"""Who gets a place at ``max_connections``, for the guarded protocol (protocol.py).

A newcomer takes the place of the longest idle connection (connection_room); when every
connection has a request in progress it is refused (503 after a pause, holding no place). A
refused newcomer whose whole request is in waits for the next place that comes free (probes
first); a refused probe may be answered at the door. A connection closed to make room is told
why after the same pause, unless it was kept alive between requests.

``Admission`` is what the connections of one protocol class share; ``AdmittingConnection`` is
the protocol's part of it (a mixin: it uses the protocol's parser state and error writer).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from common.socket_queues import has_bytes_waiting
from services.runtime.edge.connection_limits import ConnectionLimits, ConnectionStats
from services.runtime.edge.connection_room import (
    OVERFLOW,
    PACE_S,
    PACED_PER_PLACE,
    PROBE,
    ConnectionRoom,
    RefusedNewcomer,
    request_kind,
    request_waiting,
    too_many_connections,
)

IDLE, HEAD, BODY = "idle", "head", "body"  # where the parser is in the latest request


class Admission:
    """The room, the refused newcomers waiting for a place, and the count of connections that
    made room and wait to be told. Event loop thread only."""

    def __init__(self, limits: ConnectionLimits, stats: type[ConnectionStats],
                 probe_answer: Callable[[bytes], bytes | None] | None = None):
        self.limits, self.stats, self.probe_answer = limits, stats, probe_answer
        self.room = ConnectionRoom(limits.max_connections)
        self.leaving_paced = 0  # connections that made room, waiting to be told and closed
        # refused newcomers whose whole request is in, waiting for their 503: the next place
        # that comes free is offered to the oldest (probes first), not only when it is due
        self._waiting_probes: dict[Any, None] = {}
        self._waiting_whole: dict[Any, None] = {}

    def wait_for_place(self, conn: Any, kind: int) -> None:
        (self._waiting_probes if kind == PROBE else self._waiting_whole)[conn] = None

    def forget(self, conn: Any) -> None:
        self.room.gone(conn)
        self._waiting_probes.pop(conn, None)
        self._waiting_whole.pop(conn, None)

    def offer_place(self) -> None:
        """A place came free: to the oldest waiting whole request, probes first."""
        for waiting in (self._waiting_probes, self._waiting_whole):
            while waiting:
                conn = next(iter(waiting))
                refused = conn._refused
                if refused is None or not refused.waits_with():
                    del waiting[conn]  # answered, taken or gone meanwhile
                    continue
                if refused.offer():
                    del waiting[conn]
                    return
                break  # no place for this kind (a probe's reserve came free, say): it keeps its turn

    @property
    def anyone_waiting(self) -> bool:
        return bool(self._waiting_probes or self._waiting_whole)


class AdmittingConnection:
    """The protocol's side of admission. The protocol class sets ``admission`` and provides
    ``_admit`` (take the connection), ``_disarm``, ``_fail``, ``unread_since`` and
    ``cut_unread_answer`` (an answer its client does not take) and its parser state."""

    admission: Admission
    pace_s = PACE_S  # how long a refusal or a connection that made room waits to be told
    _refused: RefusedNewcomer | None
    _leave_timer: asyncio.TimerHandle | None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        a = self.admission
        admitted = a.room.make_room(len(self.connections), self.loop.time(),
                                    lambda: request_kind(request_waiting(transport)))
        if not admitted:
            a.stats.refused += 1
            self.transport = transport
            self._broken = True  # never parsed, whatever happens to its refusal
            self._refused = RefusedNewcomer(
                self.loop, transport, a.limits.max_connections, self._take_late, pace_s=random.uniform(*self.pace_s),
                answer_probe=None if a.probe_answer is None else self._answer_probe)
            return
        self._admit(transport, admitted is OVERFLOW)

    def _answer_probe(self, request: bytes) -> bytes | None:
        answer = self.admission.probe_answer(request)
        if answer is not None:
            self.admission.stats.refused -= 1
            self.admission.stats.probes_at_the_door += 1
        return answer

    def _take_late(self, request: bytes) -> bool:
        """A refused newcomer's whole request came after its connection was accepted (a
        probe that connects, then writes): taken as if it had come first, if there is room."""
        a = self.admission
        admitted = a.room.make_room(len(self.connections), self.loop.time(), lambda: request_kind(request))
        if not admitted:
            return False
        a.stats.refused -= 1
        a.stats.taken_late += 1
        self._refused = None
        self._broken = False
        self._admit(self.transport, admitted is OVERFLOW, read_now=False)  # what it sent first goes first
        self.data_received(request)
        return True

    def _refused_data(self, data: bytes) -> None:
        """Bytes from a refused newcomer: its refusal reads them; a whole request waits for a place."""
        self._refused.data_received(data)
        kind = self._refused.waits_with() if self._refused is not None else 0
        if kind:
            self.admission.wait_for_place(self, kind)

    def give_way(self) -> None:
        """Closed to make room for a newcomer (connection_room): silently when idle, with a
        503 when a head was arriving, a 408 when its body had stalled, with a reset when its
        client took none of its answer (at once: its unsent bytes are dropped). Its place is the
        newcomer's at once, but it is told (and closed) after a pause, as a refusal is:
        evicted clients that reconnect at once took each other's places in a chain as
        fast as the loop could go, and the probes queued behind them. One kept alive
        between requests is closed at once (a client's pool sees the close)."""
        limits = self.admission.limits
        self.admission.stats.evicted += 1
        self._gave_way = True
        if self.unread_since() is not None:  # its client takes nothing of its answer: reset now
            self.cut_unread_answer()
            return
        if self._phase == BODY and not self._broken:
            self._cut = True
            self._broken = True
            self._disarm()
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # its app stops now; the 408 comes later
                self.cycle.message_event.set()
            self._leave_later(lambda: self._fail(
                408, "body_stalled", f"the request body stalled while the service held "
                f"{limits.max_connections} connections: closed to make room"))
            return
        arriving = not self._broken and (self._phase == HEAD or self._waiting_bytes > 0
                                         or has_bytes_waiting(self.transport))
        self._broken = True  # silent, it lingers briefly (CUT_IDLE_S), not a client's 5 s
        self._disarm()

        def leave() -> None:
            # a request that came while it waited (its reading paused) is told why, not dropped
            if not self.transport.is_closing() and (arriving or has_bytes_waiting(self.transport)):
                self.transport.write(too_many_connections(limits.max_connections))
            self.transport.close()
        if self._message_no and not arriving:
            # kept alive between requests: a client's pool checks for a close before reusing
            # it, and opens a new connection; closed after a pause it got 503 instead
            leave()
            return
        self._leave_later(leave)

    def _leave_later(self, leave: Callable[[], None]) -> None:
        a = self.admission
        if a.leaving_paced >= PACED_PER_PLACE * a.limits.max_connections or self.transport.is_closing():
            leave()  # a bound on descriptors held for that: at once beyond it
            return
        a.leaving_paced += 1
        self.transport.pause_reading()

        def now() -> None:
            self._leave_timer = None
            a.leaving_paced -= 1
            leave()
        self._leave_timer = self.loop.call_later(random.uniform(*self.pace_s), now)

    def _admission_lost(self) -> bool:
        """The connection is gone: its place, its wait and its pause end. Whether it was a
        refused newcomer (nothing else of it to clean up)."""
        if self._leave_timer is not None:  # its client went first
            self._leave_timer.cancel()
            self._leave_timer = None
            self.admission.leaving_paced -= 1
        self.admission.forget(self)
        if self._refused is not None:
            self._refused.gone()
            return True
        return False

"""Who gets a place at ``max_connections``, for the guarded protocol (protocol.py).

A newcomer takes the place of the longest idle connection (connection_room); when every
connection has a request in progress it is refused (503 after a pause, holding no place). A
refused newcomer whose request has begun waits in line for the next place that comes free
(probes first), up to ``connection_queue_timeout_s``; a refused probe may be answered at the
door. A connection closed to make room is told why after the same pause, unless it was kept
alive between requests.

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
    WHOLE,
    ConnectionRoom,
    RefusedNewcomer,
    read_normally,
    request_kind,
    request_waiting,
    too_many_connections,
)

IDLE, HEAD, BODY = "idle", "head", "body"  # where the parser is in the latest request
LINE_TICK_S = 0.1      # the room asked again this often while anyone waits in line
OFFERS_PER_TURN = 4    # places given in one turn of the loop (the rest in the next turns)


class Admission:
    """The room, the line of refused newcomers waiting for a place, and the count of connections
    that made room and wait to be told. Event loop thread only.

    The line: a refused newcomer whose request has begun (a head, a whole request, an upload's
    first bytes) waits for a place for up to ``connection_queue_timeout_s`` from its accept
    (HAProxy's ``timeout queue``), then gets its 503. Places go to the oldest first, probes
    before all; a newcomer that arrives while anyone waits goes behind them (a probe excepted),
    and the room is asked again every LINE_TICK_S, since what may make room (an idle
    connection, a stalled body, an unread answer) becomes so with time, not only when a
    connection ends. One client reconnecting 700 connections at once, each reading nothing,
    took every place that came free ahead of the clients that waited (95 of 114 legitimate
    reads got 503): a newcomer could take a place the moment it arrived, a waiting one only
    when its turn came at a close."""

    def __init__(self, limits: ConnectionLimits, stats: type[ConnectionStats],
                 probe_answer: Callable[[bytes], bytes | None] | None = None):
        self.limits, self.stats, self.probe_answer = limits, stats, probe_answer
        self.room = ConnectionRoom(limits.max_connections)
        self.leaving_paced = 0  # connections that made room, waiting to be told and closed
        self._probes: dict[Any, None] = {}  # refused newcomers with a whole GET of a probe's path
        self._line: dict[Any, None] = {}    # the others with a request begun, oldest first
        self._whole: dict[Any, None] = {}   # of those, the whole requests (which may take the overflow)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._next_turn: asyncio.Handle | None = None

    @property
    def line_ahead(self) -> bool:
        """Do newcomers wait for a place? Then one arriving goes behind them. (The first ones,
        answered or taken since, are dropped now: left until the next tick they refused every
        newcomer meanwhile.)"""
        return self._first(self._line) is not None

    def _drop(self, conn: Any) -> None:
        self._probes.pop(conn, None)
        self._line.pop(conn, None)
        self._whole.pop(conn, None)

    def wait_for_place(self, conn: Any, kind: int, loop: asyncio.AbstractEventLoop) -> None:
        """``conn``, refused, has begun a request (``kind``): into the line, if not there yet,
        and a place offered at once if one is free for the first in line."""
        self._loop = loop
        if kind == PROBE:
            self._drop(conn)
            self._probes[conn] = None
        else:
            self._line.setdefault(conn, None)
            if kind == WHOLE:
                self._whole.setdefault(conn, None)
        conn._refused.wait_in_line(self.limits.connection_queue_timeout_s)
        self.offer_place()

    def forget(self, conn: Any) -> None:
        self.room.gone(conn)
        self._drop(conn)

    def offer_place(self) -> None:
        """Places to the waiting, for as long as the room gives them: OFFERS_PER_TURN now, the
        rest in the next turns of the loop (each one taken is a connection set up, its request
        begun and perhaps another reset: a few a turn, so that the probes come round between
        them, as the door sets up SETUPS_PER_TURN a turn)."""
        for _ in range(OFFERS_PER_TURN):
            if not (self._offer_probe() or self._offer_line()):
                break
        else:
            if self._next_turn is None and self._loop is not None:
                self._next_turn = self._loop.call_soon(self._on_next_turn)
        self._arm()

    def _on_next_turn(self) -> None:
        self._next_turn = None
        self.offer_place()

    def _offer_probe(self) -> bool:
        conn = self._first(self._probes)
        if conn is not None and conn._refused.offer():
            self._drop(conn)
            return True
        return False

    def _offer_line(self) -> bool:
        """A place to the oldest in line; failing that, when it has only begun its request (no
        place within the limit for it), to the oldest whole request, which may take one beyond
        the limit (a GET behind 32 uploads waited for its 503 before)."""
        conn = self._first(self._line)
        if conn is None:
            return False
        if conn._refused.offer():
            self._drop(conn)
            return True
        if conn in self._whole:
            return False  # no place, nor any beyond the limit: the rest keep their turns
        whole = self._first(self._whole)
        if whole is not None and whole._refused.offer():
            self._drop(whole)
            return True
        return False

    def _first(self, queue: dict[Any, None]) -> Any:
        """The first of ``queue`` still waiting; those answered, taken or gone meanwhile dropped."""
        while queue:
            conn = next(iter(queue))
            if conn._refused is not None and conn._refused.waits_with():
                return conn
            self._drop(conn)
        return None

    def _arm(self) -> None:
        if self._tick is None and self._loop is not None and (self._probes or self._line):
            self._tick = self._loop.call_later(LINE_TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        self.offer_place()

    @property
    def anyone_waiting(self) -> bool:
        return bool(self._probes or self._line)


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
        if a.line_ahead:  # behind those waiting for a place, unless a probe
            kind = request_kind(request_waiting(transport))
            admitted = kind == PROBE and a.room.make_room(len(self.connections), self.loop.time(), lambda: kind)
        else:
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
        """A refused newcomer's turn in the line (its request begun, perhaps whole): taken,
        if the room has a place for it, as if it had come first (beyond the limit only if
        whole); what it sent is read as the connection's first bytes, the rest from its socket."""
        a = self.admission
        admitted = a.room.make_room(len(self.connections), self.loop.time(), lambda: request_kind(request))
        if not admitted:
            return False
        a.stats.refused -= 1
        a.stats.taken_late += 1
        refused, self._refused = self._refused, None
        refused.gone()  # its 503 timer and its count end here, whatever happens below
        self._broken = False
        self._admit(self.transport, admitted is OVERFLOW, read_now=False)  # what it sent first goes first
        read_normally(self.transport)
        self.transport.resume_reading()  # paused when its first bytes filled a head's worth
        self.data_received(request)
        return True

    def _refused_data(self, data: bytes) -> None:
        """Bytes from a refused newcomer: its refusal reads them; a whole request waits for a place."""
        self._refused.data_received(data)
        kind = self._refused.waits_with() if self._refused is not None else 0
        if kind:
            self.admission.wait_for_place(self, kind, self.loop)

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

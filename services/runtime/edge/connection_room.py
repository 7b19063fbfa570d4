"""Which connection gives way when a public port holds ``max_connections``.

Refusing every newcomer at the limit hands the port to whoever opens connections first:
600 sockets that never send a byte would take ``/healthz`` away from the orchestrator and
every client away from the service until their header deadline. So, as the supervisor's
probe port does (supervisor/servers/connection_slots.py), a newcomer is not turned away
while some connection does nothing useful: the one idle longest is closed to make room,
that is one that never sent a byte or a kept-alive one between requests (a client must
expect a kept-alive connection to close at any time). Failing those, the one that has
waited longest for the rest of an unfinished request head. Failing those, one whose request
body is owed by its client and has stalled (nothing for STALLED_BODY_S, its reading not held
back by the service): 600 clients that send a head with ``Expect: 100-continue`` and then no
body held every connection in progress, and every newcomer, /healthz included, got 503 until
their body deadline. Failing those, one whose answer its client has taken nothing of for
STALLED_ANSWER_S (writing paused on it): 700 clients asking for a job's result and never
reading held every place until the send deadline, and every other reader got 503 (it is
reset, as the send deadline would do later). A connection with any other request in
progress (its body arriving or held back by the service, its answer being made or taken by
its client, requests pipelined behind it) is never closed that way: only when every
connection has one is a newcomer refused, unless what it sent is already a whole request
with nothing more to wait for (a probe, a small upload): it is answered and gone at once,
so up to QUICK_OVERFLOW such newcomers are taken beyond the limit (connections that hold
bodies back kept /healthz at 503 otherwise: each one that made room was taken at once by
the holders' own reconnects).

Real clients send their request the moment they connect, usually before the service
accepts them: a newcomer whose bytes are already waiting counts as a head arriving, not
as idle, so a flood of silent connections makes room with its own members first. One idle
(or arriving) for under FRESH_S never gives way: a probe accepted before its bytes came is
idle for a moment, and was the one closed.

Whoever is turned away, or closed to make room, is told so after a pause (PACE_S), holding
no place meanwhile: clients that reconnect the moment they are answered (hundreds of them,
ignoring Retry-After) otherwise come back as fast as the loop can turn them away, and a
probe waits behind all of them in the accept queue.

Event loop thread only; no lock.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from itertools import islice
from typing import Any, Protocol

from common.http1 import whole_request
from common.socket_queues import TCP_CLOSE, TCP_CLOSE_WAIT, has_bytes_waiting, tcp_state, waiting_bytes
from services.runtime.edge.connection_limits import error_bytes
from services.runtime.edge.read_turns import READ_AT_ONCE_BYTES

LINGER_S = 1.0
PACE_S = (0.5, 1.0)     # a refusal's 503 is written after this long (uniform: reconnects do not come in waves)
STALLED_BODY_S = 1.0   # a body owed by its client with nothing for this long may make room
STALLED_ANSWER_S = 2.0  # an answer its client took nothing of for this long may make room
FRESH_S = 1.0          # idle (or a head arriving) for less: never closed to make room
STALLED_SCAN = 32      # bodies looked at for one newcomer (those the service holds back go last)
QUICK_OVERFLOW = 1 / 8  # of the limit: newcomers with a whole request taken beyond it (at least 8)
OVERFLOW = 2            # make_room's answer for a newcomer taken beyond the limit (True: within it)
PROBE_RESERVE = 8       # beyond the overflow, for probes only: clients' own whole requests filled it
WHOLE, PROBE = 1, 2     # what quick() may say of a newcomer's bytes (0: not a whole request)
BEGUN = 3               # what a refused newcomer waits with: a request begun, not whole (a head, an upload)
PROBE_TARGETS = frozenset({b"/healthz", b"/readyz"})
PACED_PER_PLACE = 2      # refusals waiting (or lingering) at once, and connections told after making room, each
                         # up to this many times max_connections: beyond, at once (1500 reconnecting clients
                         # against 512 places went past a bound of 1024 and came back at loop speed)
_lingering = [0]  # refused connections waiting or draining, across the process (event loop thread only)
_waiting: dict[RefusedNewcomer, None] = {}  # refused connections whose 503 is still to come, oldest first


class Evictable(Protocol):
    def give_way(self) -> None:
        """Close now to make room for a newcomer."""

    def owes_body(self) -> bool:
        """Is the rest of its request body the client's to send now (not held back by us)?"""

    def unread_since(self) -> float | None:
        """Since when its client has taken nothing of its answer (writing paused on it), on
        the loop's clock; None when its answer is not waiting on its client."""


class ConnectionRoom:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit, self.clock = limit, clock  # the loop's clock (asyncio's is time.monotonic)
        self._idle: dict[Evictable, float] = {}      # since when, idle the longest first
        self._arriving: dict[Evictable, float] = {}  # a head begun (when): waiting the longest first
        self._bodies: dict[Evictable, float] = {}    # a body arriving, by the time of its last read
        self._unread: dict[Evictable, float] = {}    # an answer its client does not take: since when
        self._leaving: set[Evictable] = set()        # closed to make room, not gone yet

    def make_room(self, open_now: int, now: float = 0.0, quick: Callable[[], int] = lambda: 0) -> bool | int:
        """Before a newcomer is accepted (``open_now`` connections are open, ``now`` on the
        loop's clock): True when it may stay, after closing, if the port is full, the longest
        idle connection (or failing that, the oldest arriving head) of those so for FRESH_S,
        else a stalled body (one idle or arriving for less is never closed: it may be a probe
        accepted before its bytes came); or when
        ``quick()`` says it sent a whole request (WHOLE, or PROBE: a GET of a probe's path,
        which may also take the PROBE_RESERVE beyond) and the overflow has room (then OVERFLOW: the
        connection serves that request only); False when every connection has a request in
        progress."""
        if open_now - len(self._leaving) < self.limit:
            return True
        # one taken as idle whose request has arrived since (not read yet on a busy loop) is
        # arriving: it moves on, once, and the next idle one is looked at
        while self._idle and has_bytes_waiting(getattr(first := next(iter(self._idle)), "transport", None)):
            self.arriving(first)
        victim = (self._settled(self._idle, now) or self._settled(self._arriving, now) or self._stalled_body(now)
                  or self._unread_answer(now))
        if victim is None:
            overflow = max(8, int(self.limit * QUICK_OVERFLOW))
            if open_now - len(self._leaving) >= self.limit + overflow + PROBE_RESERVE:
                return False
            kind = quick()  # only now: it peeks at the socket
            if kind == PROBE or (kind and open_now - len(self._leaving) < self.limit + overflow):
                return OVERFLOW
            return False
        for listed in (self._idle, self._arriving, self._bodies, self._unread):
            listed.pop(victim, None)
        self._leaving.add(victim)  # still open until its connection_lost: not counted twice
        victim.give_way()
        return True

    def _settled(self, pool: dict[Evictable, float], now: float) -> Evictable | None:
        """The first of ``pool`` (the longest idle, or the oldest head) if it has been so for
        FRESH_S: a connection just accepted is idle until its request is read, and under a
        flood of reconnects a probe's was the one closed (the chain of evictions took the
        idle one first)."""
        first = next(iter(pool), None)
        return first if first is not None and now - pool[first] >= FRESH_S else None

    def _stalled_body(self, now: float) -> Evictable | None:
        """The body owed the longest, if nothing came for it for STALLED_BODY_S; one the service
        holds back goes to the end of the list (its time kept) and the next is looked at."""
        for _ in range(min(STALLED_SCAN, len(self._bodies))):
            conn, last_read = next(iter(self._bodies.items()))
            if now - last_read < STALLED_BODY_S:
                return None  # the rest were read later (bar those moved to the end)
            if conn.owes_body():
                return conn
            del self._bodies[conn]
            self._bodies[conn] = last_read
        return None

    def _unread_answer(self, now: float) -> Evictable | None:
        """Of the answers waiting longest on their clients, the first whose client has taken
        nothing of it for STALLED_ANSWER_S (a slow reader keeps taking some: it stays)."""
        for conn, paused_at in list(islice(self._unread.items(), STALLED_SCAN)):
            if now - paused_at < STALLED_ANSWER_S:
                return None  # the rest paused later
            since = conn.unread_since()
            if since is None:
                del self._unread[conn]  # taken since, unbeknown: listed again when it waits again
            elif now - since >= STALLED_ANSWER_S:
                return conn
        return None

    def answer_unread(self, conn: Evictable, since: float) -> None:
        """An answer in progress that its client has taken nothing of since ``since``: closed
        to make room only after STALLED_ANSWER_S of that."""
        if conn not in self._leaving:
            self._idle.pop(conn, None)
            self._arriving.pop(conn, None)
            self._bodies.pop(conn, None)
            self._unread.setdefault(conn, since)

    def arrived(self, conn: Evictable, transport: Any) -> None:
        """A connection accepted: idle, unless its request's bytes are already waiting."""
        if has_bytes_waiting(transport):
            self.arriving(conn)
        else:
            self.no_request(conn)

    def no_request(self, conn: Evictable) -> None:
        """Nothing in progress (sent nothing yet, or kept alive after its answers): idle from now."""
        if conn not in self._leaving:
            self._arriving.pop(conn, None)
            self._idle.pop(conn, None)
            self._idle[conn] = self.clock()

    def arriving(self, conn: Evictable) -> None:
        """A request head arriving; it keeps its place while more of it comes."""
        if conn not in self._leaving:
            self._idle.pop(conn, None)
            self._arriving.setdefault(conn, self.clock())

    def body_arriving(self, conn: Evictable, last_read: float) -> None:
        """A request body arriving, its last bytes read at ``last_read``: closed to make room
        only once it has stalled (see _stalled_body)."""
        if conn not in self._leaving:
            self._idle.pop(conn, None)
            self._arriving.pop(conn, None)
            self._bodies.pop(conn, None)
            self._bodies[conn] = last_read

    def busy(self, conn: Evictable) -> None:
        """A request in progress: never closed to make room."""
        self._idle.pop(conn, None)
        self._arriving.pop(conn, None)
        self._bodies.pop(conn, None)
        self._unread.pop(conn, None)

    def gone(self, conn: Evictable) -> None:
        self.busy(conn)
        self._leaving.discard(conn)

    def counts(self) -> dict[str, int]:
        return {"idle": len(self._idle), "arriving": len(self._arriving), "bodies": len(self._bodies),
                "unread": len(self._unread), "leaving": len(self._leaving)}


def request_waiting(transport: Any) -> bytes:
    """What the client has sent and nobody has read yet, up to a small request's size
    (read_turns.READ_AT_ONCE_BYTES), left in the socket."""
    try:
        fd = transport.get_extra_info("socket").fileno()
    except (OSError, AttributeError, ValueError):
        return b""
    return waiting_bytes(fd, READ_AT_ONCE_BYTES)


def read_small(transport: Any) -> None:
    """Its reads in pieces of READ_AT_ONCE_BYTES, not asyncio's 256 KiB: a refused newcomer keeps
    what it reads until its turn (a thousand of them, a few MiB). CPython's selector transport
    reads ``max_size`` at a time; another transport reads as it does."""
    if isinstance(getattr(type(transport), "max_size", None), int):
        transport.max_size = READ_AT_ONCE_BYTES


def read_normally(transport: Any) -> None:
    getattr(transport, "__dict__", {}).pop("max_size", None)


def request_kind(data: bytes) -> int:
    """0 unless ``data`` is one whole request (whole_request); PROBE for a GET of a probe's
    path, else WHOLE."""
    if not whole_request(data):
        return 0
    line = data[:data.find(b"\r\n")].split(b" ")
    return PROBE if len(line) == 3 and line[0] == b"GET" and line[1] in PROBE_TARGETS else WHOLE


def too_many_connections(limit: int) -> bytes:
    return error_bytes(503, "too_many_connections", f"the service holds {limit} connections; retry later",
                       b"retry-after: 1\r\n")


class RefusedNewcomer:
    """A newcomer refused because every connection has a request in progress. Its 503 is not
    written at once but after a pause (PACE_S, jittered; the Retry-After is 1 s anyway): a
    client answered at once reconnects at once, and a few hundred of them that ignore
    Retry-After kept the accept queue 90 deep, a /healthz probe waiting behind each of them
    (detect p99 186-443 ms). Paused, each costs a timer and its descriptor, and comes back
    at most about once a second.

    While it waits, what it sends is kept (READ_AT_ONCE_BYTES or so, read in small pieces,
    then reading pauses and the rest waits in the socket): once a request has begun it waits
    in the admission's line (admission.py) for the next place, up to the line's timeout, and
    is handed to ``take_late`` when its turn comes (``offer``), a whole request possibly
    beyond the limit, as it would have been had its bytes come first. Then, if no place came,
    the 503, a half-close, and a lingering close (what the client sends is dropped; closed on
    its EOF or after LINGER_S): closing with unread data sends a reset that destroys the 503
    before the client reads it.
    Bounded: past PACED_PER_PLACE x the connection limit refused connections waiting or
    lingering at once, the one waiting longest is answered early; past twice that, the next
    one is answered and closed at once."""

    __slots__ = ("_loop", "_transport", "_limit", "_timer", "_counted", "_seen", "_take_late", "_answered",
                 "_answer_probe", "_since", "_due", "_kind")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, limit: int,
                 take_late: Callable[[bytes], bool] | None = None, pace_s: float | None = None,
                 answer_probe: Callable[[bytes], bytes | None] | None = None):
        self._loop, self._transport, self._limit = loop, transport, limit
        self._since = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._seen = b""
        self._kind = 0  # request_kind of what it sent, or BEGUN (0: nothing yet)
        self._take_late = take_late
        self._answer_probe = answer_probe  # a whole GET /healthz is answered here, needing no place
        self._answered = False
        # past the bound, the refusal waiting longest is answered now and this one waits in its
        # stead (a newcomer refused at once had no time to send its request: a probe among
        # hundreds of reconnecting clients got an instant 503); those answered early linger
        # until their clients close, so the count may pass the bound, up to twice it
        bound = PACED_PER_PLACE * limit
        if _lingering[0] >= bound and _waiting:
            next(iter(_waiting))._answer()
        if _lingering[0] >= 2 * bound or not transport.can_write_eof():
            self._answered = True
            door = self._probe_in_socket()
            transport.write(door or too_many_connections(limit))
            if door is not None and transport.can_write_eof():
                transport.write_eof()  # its request is read and dropped before the close (no reset)
                loop.call_later(LINGER_S, transport.close)
            else:
                transport.close()
            return
        _lingering[0] += 1
        self._counted = True
        read_small(transport)  # what it sends before its turn is kept: a head's worth, not 256 KiB
        if pace_s is None:
            pace_s = random.uniform(*PACE_S)
        self._due = self._since + pace_s
        self._timer = loop.call_later(pace_s, self._answer)
        _waiting[self] = None

    def _probe_in_socket(self) -> bytes | None:
        """The door's answer to a whole GET /healthz already in the socket, not read yet."""
        if self._answer_probe is None:
            return None
        data = request_waiting(self._transport)
        return self._answer_probe(data) if request_kind(data) == PROBE else None

    def data_received(self, data: bytes) -> None:
        """Bytes from the client: dropped once answered; while it waits, kept for its turn
        (READ_AT_ONCE_BYTES of them, the rest left in the socket). A whole GET /healthz is
        answered at once, at the door."""
        if self._answered or self._take_late is None:
            return
        self._seen += data
        self._kind = request_kind(self._seen) or BEGUN  # once here, not at each look at the line
        if len(self._seen) >= READ_AT_ONCE_BYTES:  # not a probe: the rest waits in the socket
            self._transport.pause_reading()
        if self._answer_probe is not None and self._kind != BEGUN:
            reply = self._answer_probe(self._seen)
            if reply is not None:
                self._write_and_linger(reply)

    def waits_with(self) -> int:
        """What it sent, while it waits for its 503: request_kind of it, or BEGUN for a request
        begun (0 once answered, or when it sent nothing)."""
        return 0 if self._answered or self._take_late is None else self._kind

    def wait_in_line(self, wait_s: float) -> None:
        """Its request has begun: its 503 waits until ``wait_s`` after it was accepted, if that
        is later than its pause, for a place to come free (admission's line)."""
        if self._timer is None or self._answered:
            return
        if self._since + wait_s > self._due:
            self._due = self._since + wait_s
            self._timer.cancel()
            self._timer = self._loop.call_later(self._due - self._loop.time(), self._answer)

    def offer(self) -> bool:
        """A place came free: take it, if a request has begun. Whether it did. One whose client
        has left (its reading paused, the reset or the close unseen) is closed instead: taken,
        it would have made a live connection give way."""
        if not self.waits_with() or self._transport.is_closing():
            return False
        sock = self._transport.get_extra_info("socket")
        if sock is not None and tcp_state(sock) in (TCP_CLOSE, TCP_CLOSE_WAIT):
            self._answered = True
            self._transport.close()
            return False
        if self._take_late(self._seen):
            self.gone()
            return True
        return False

    def _answer(self) -> None:
        if self._timer is not None:  # answered early, to make room for a newer refusal
            self._timer.cancel()
        self._timer = None
        _waiting.pop(self, None)
        transport = self._transport
        if transport.is_closing():
            self._answered = True
            return
        if self.offer():  # a place came free while it waited
            return
        # answered early, its request may be in the socket still, not read yet
        door = self._probe_in_socket() if not self._seen else None
        self._write_and_linger(door or too_many_connections(self._limit))

    def _write_and_linger(self, answer: bytes) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        _waiting.pop(self, None)
        self._answered = True
        self._seen = b""
        transport = self._transport
        read_normally(transport)  # drained and dropped: in big reads
        transport.write(answer)
        try:
            transport.write_eof()
        except OSError:  # the client reset the connection: nothing to linger for
            transport.close()
            return
        transport.resume_reading()  # drained and dropped until the client closes
        self._timer = self._loop.call_later(LINGER_S, transport.close)

    def client_closed(self) -> None:
        """The client shut its side: it may still read, so it gets its answer now."""
        if not self._answered and not self._transport.is_closing():
            self._transport.write(too_many_connections(self._limit))
        self._answered = True
        _waiting.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()

    def gone(self) -> None:
        """Its connection is lost, or it was taken after all: nothing more to do."""
        _waiting.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counted:
            self._counted = False
            _lingering[0] -= 1

"""uvicorn's httptools protocol with the limits uvicorn does not have (docs/limits.md).

uvicorn caps neither the connections it holds open, nor the size of a request's headers as
they arrive, nor the time a client may take to send them or to read its answer: its
keep-alive timer is reset by every byte, so a client trickling one byte at a time holds a
connection forever (uvicorn issue 157). Here, per connection:

- at ``max_connections`` a newcomer takes the place of the longest idle connection; only
  when every connection has a request in progress is it refused (503 after a pause,
  holding no place): never descriptor exhaustion (admission, connection_room);
- a request head's bytes are counted as they arrive: past ``max_header_bytes`` (or
  ``max_header_count`` fields) 431 within one read, however the head is cut;
- a head must arrive within ``header_timeout_s``, a body within ``body_timeout_s`` and at
  ``min_body_rate_bytes_s`` on average (receive_deadlines); else 408 and a close, written
  after the answers still owed to earlier requests, never in their place;
- at most ``max_pipelined_requests`` wait behind the one being answered (then 429);
- a body's framing cannot make the service read much more than the body limit (413 past
  twice ``max_body_bytes``), nor cost the loop a callback per byte (413 for chunks that
  average under ``min_body_chunk_bytes``);
- an answer the client does not take is reset after ``send_timeout_s`` without progress
  (send_deadline);
- a connection closed while its request body still arrives lingers: the client's bytes are
  read and dropped until it closes, so that it reads its 413 or 503 instead of a reset
  (lingering_close);
- a request uvicorn cannot parse, or a client that half-closes inside its request, gets
  400 in the JSON error envelope.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.socket_queues import has_bytes_waiting
from services.runtime.edge.admission import BODY, HEAD, IDLE, Admission, AdmittingConnection
from services.runtime.edge.body_bytes import BodyBytes
from services.runtime.edge.body_pace import BodyRate, chunks_too_small, framing_too_large
from services.runtime.edge.connection_limits import ConnectionLimits, ConnectionStats, Refusal, error_bytes
from services.runtime.edge.connection_room import RefusedNewcomer
from services.runtime.edge.expect_continue import close_if_refused_before_continue, stamp_the_continue
from services.runtime.edge.lingering_close import LingeringClose
from services.runtime.edge.read_turns import ReadTurns, TurnedFlowControl, read_at_once
from services.runtime.edge.receive_deadlines import ReceiveDeadlines
from services.runtime.edge.send_deadline import KernelQueueLinger, SendWatch, cap_send_buffer, reset
from services.runtime.edge.start_turns import PendingStart, StartTurns, is_probe
from services.runtime.edge.upgrade_header import without_upgrade

# scope["extensions"][END_EXTENSION](hard): an app ending its answer short ends the connection
END_EXTENSION = "onecard.end_short"


def _ender(protocol: Any, cycle: Any) -> Callable[[bool], None]:
    """Weak both ways: the scope holds this, and the protocol holds the scope's cycle."""
    protocol_ref, cycle_ref = weakref.ref(protocol), weakref.ref(cycle)

    def end_connection(hard: bool) -> None:
        protocol_now, cycle_now = protocol_ref(), cycle_ref()
        if protocol_now is not None and cycle_now is not None:
            protocol_now.end_for_app(cycle_now, hard)
    return end_connection

__all__ = ["ConnectionLimits", "ConnectionStats", "error_bytes", "guarded_protocol"]


def _nothing() -> None:
    pass


def guarded_protocol(limits: ConnectionLimits, stats: type[ConnectionStats] = ConnectionStats,
                     linger: KernelQueueLinger | None = None,
                     probe_answer: Callable[[bytes], bytes | None] | None = None,
                     bodies: BodyBytes | None = None) -> type:
    """A protocol class for uvicorn's ``http=`` setting, bound to these limits.
    ``probe_answer``: the whole answer to a probe's request (or None for any other) that a
    newcomer refused at max_connections gets at once, needing no place. ``bodies``: the tally
    of request bodies being read (body_bytes: the heap trimmed after a burst)."""
    if bodies is None:
        bodies = BodyBytes()
    if linger is None:
        linger = KernelQueueLinger(limits.send_timeout_s, limits.max_connections)
    admission = Admission(limits, stats, probe_answer)
    lingering = LingeringClose(limits.max_connections, drain_bytes_s=limits.lingering_drain_bytes_s)
    turns = ReadTurns(stats)
    starts = StartTurns(stats)

    def too_large(what: str) -> Refusal:
        return Refusal(431, "headers_too_large", what, "headers_too_large")

    room = admission.room

    class GuardedHttpProtocol(AdmittingConnection, ReceiveDeadlines, HttpToolsProtocol):
        edge_limits, edge_stats = limits, stats

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._refused: RefusedNewcomer | None = None
            self._deadline: asyncio.TimerHandle | None = None
            self._deadline_for: tuple[str, int] | None = None
            self._phase = IDLE
            self._message_no = 0       # requests begun on this connection
            self._waiting_bytes = 0    # bytes read towards the next request's head
            self._head_bytes = 0       # URL and finished headers of the head being parsed
            self._header_count = 0
            self._body_bytes = 0       # bytes read while in this request's body
            self._framing_bytes = 0    # of those, what was not body data (chunk lines, trailers)
            self._heads_in_read = 0    # heads finished during the current read
            self._active = None        # the cycle being answered
            self._waiting_start: PendingStart | None = None  # the last request put in the queue of starts
            self._pending_error: tuple[int, str, str] | None = None
            self._broken = False       # no more parsing on this connection
            self._was_reset = False
            self._cut = False          # cut by the edge (a deadline, a limit): a brief lingering close
            self._gave_way = False     # closed to make room: lingers while its client still sends
            self._send_watch: SendWatch | None = None
            self._body_rate: BodyRate | None = None
            self._chunks = 0           # chunk headers of this request's body
            self._last_read_at = 0.0   # on the loop's clock: a stalled body may make room (connection_room)
            self._head_tail = b""      # the last bytes of the previous read (upgrade_header)
            self._overflow = False     # taken beyond max_connections with a whole request
            self._body_data = 0        # its bytes without the framing
            self._body_held = 0        # of those, counted in ``bodies`` and not let go yet
            self._leave_timer: asyncio.TimerHandle | None = None  # made room: told and closed then
            self._paused_at: float | None = None  # writing paused on the client since (loop time)

        # ---- connections ------------------------------------------------------------
        def _admit(self, transport: asyncio.Transport, overflow: bool, read_now: bool = True) -> None:
            self._overflow = overflow  # answered, then closed: never a second request
            HttpToolsProtocol.connection_made(self, transport)  # AdmittingConnection's decided this
            self.flow = TurnedFlowControl(transport, turns, self.loop)  # before any request takes it
            room.arrived(self, transport)
            cap_send_buffer(transport, limits.send_buffer_bytes)
            self._send_watch = SendWatch(self.loop, transport, limits.send_timeout_s, self._on_send_stuck)
            self._body_rate = BodyRate(self.loop, limits.min_body_rate_bytes_s, limits.body_rate_grace_s,
                                       lambda: self._body_bytes, self._client_waits, self._on_body_too_slow)
            self._update_receive_deadline()
            if read_now:
                read_at_once(transport)

        def _update_room(self) -> None:
            if self._broken or self.transport.is_closing():
                return
            if (self._phase == BODY and not self.pipeline and not self._earlier_answers_pending()
                    and self.cycle is not None and not self.cycle.response_started):
                room.body_arriving(self, self._last_read_at)
            elif (self._phase == BODY or self.pipeline or self._earlier_answers_pending()
                    or (self.cycle is not None and not self.cycle.response_complete)):
                # an answer begun before its request's body is in counts too: 600 clients sending
                # GET with a 50 MB body at 2 kB/s and reading none of the answer held every place
                if self._paused_at is not None and (self._phase != BODY or self.cycle.response_started):
                    room.answer_unread(self, self._paused_at)
                else:
                    room.busy(self)
            elif self._phase == HEAD or self._waiting_bytes > 0:
                room.arriving(self)
            else:
                room.no_request(self)

        def _body_owed_now(self) -> None:
            """The body is the client's to send from now (its 100 Continue is being written): its
            stall is counted from here, not from the last read. (Reading paused by the service
            needs no such mark: the bytes the client could not send wait in the socket and are
            read, and counted, as soon as it resumes.)"""
            self._last_read_at = self.loop.time()
            self._update_room()

        def owes_body(self) -> bool:
            return (self._phase == BODY and not self._broken and not self._client_waits()
                    and not has_bytes_waiting(self.transport))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._let_go_of_body()
            if self._admission_lost():
                self.parser = None  # never used; it holds this protocol's callbacks
                self._let_go()
                return
            if self._send_watch is not None:
                self._send_watch.stop()
            if exc is None and not self._was_reset:
                sock = self.transport.get_extra_info("socket")
                # a body still arriving is read and dropped after the answer (its reset would
                # destroy the answer; briefly after the edge cut it); else the answer's unsent
                # tail is watched
                if sock is not None and not lingering.adopt(self.loop, sock, self._phase == BODY, cut=self._cut,
                                                            quiet=self._gave_way):
                    linger.adopt(self.loop, sock)
            super().connection_lost(exc)
            self._tell_all_disconnected()
            self._let_go()
            if admission.anyone_waiting:
                admission.offer_place()

        def _tell_all_disconnected(self) -> None:
            """uvicorn tells only the newest request (self.cycle) that its client left: with a
            request pipelined behind it, the one being answered never saw http.disconnect (its
            GPU work was not cancelled; its answer went on being written to a reset socket,
            each write a warning in the log)."""
            for cycle in (self._active, *(c for c, _ in self.pipeline)):
                if cycle is not None and cycle is not self.cycle and not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()

        def _let_go(self) -> None:
            """Break the reference cycles a connection is made of (its watchers' callbacks
            are its own methods; a request's wrapped send and receive hold their cycle), so
            that it is freed when its last task ends rather than by the cyclic collector:
            evicted and refused connections by the hundred left 40 000 objects a second to
            full collections, each a 50-150 ms pause of the loop."""
            self._send_watch = self._body_rate = self._refused = None
            if self._waiting_start is not None:
                self._waiting_start.let_go()
                self._waiting_start = None
            # uvicorn cancels its keep-alive timer only when the connection ended cleanly: after
            # a reset it kept the protocol 5 s, then in a cycle with the fired timer (32 clients
            # resetting after their answers: 18 000 dead connections, 100 MiB, left to the collector)
            self._unset_keepalive_if_required()
            # asyncio's selector transport keeps its read callback as a bound method of itself
            getattr(self.transport, "__dict__", {}).pop("_read_ready_cb", None)
            for cycle in {self.cycle, self._active, *(c for c, _ in self.pipeline)}:
                if cycle is not None:  # a running app keeps what it was given
                    cycle.__dict__.pop("send", None)
                    cycle.__dict__.pop("receive", None)
                    # a cycle whose app never ran to its end (uvicorn clears this then) held this
                    # protocol by its bound method: 6 000 clients a second sending and hanging up
                    # made 13 objects of cyclic garbage each, a collection of 8-14 ms 4 times a
                    # second; every cycle is disconnected by now, and its send returns before it
                    cycle.on_response = _nothing

        def eof_received(self) -> bool | None:
            if self._refused is not None:
                self._refused.client_closed()
                return None
            # A client that closes its side in the middle of a request will never finish it:
            # say so (it may still read) rather than close without a word.
            if not self._broken and self._incomplete_request() and not self._earlier_answers_pending():
                self._fail(400, "incomplete_request", "the client closed its side before the request was complete")
            return None  # asyncio closes the connection; a running request sees a disconnect

        def _incomplete_request(self) -> bool:
            if self._phase == HEAD or (self._phase == IDLE and self._waiting_bytes > 0):
                return True
            return self._phase == BODY and self.cycle is not None and not self.cycle.response_started

        # ---- answers: the send deadline and the order of answers ----------------------
        def pause_writing(self) -> None:
            if self._send_watch is None:
                return  # a refused connection: its 503 is all it gets, closed within a second
            super().pause_writing()
            self._send_watch.start()
            self._paused_at = self.loop.time()
            self._update_room()

        def resume_writing(self) -> None:
            if self._send_watch is None:
                return
            super().resume_writing()
            self._send_watch.stop()
            self._paused_at = None
            self._update_room()

        def unread_since(self) -> float | None:
            """Since when its client has taken nothing of its answer (None: not waiting on it)."""
            if self._paused_at is None or self._broken or self.transport.is_closing() or self._send_watch is None:
                return None
            return self._send_watch.last_taken()

        def cut_unread_answer(self) -> None:
            """Closed to make room (connection_room): its client took nothing of its answer for
            STALLED_ANSWER_S while the port was full. Reset, as the send deadline would later."""
            self._broken = True
            for cycle in (self._active, self.cycle):
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._reset_connection()

        def end_for_app(self, cycle, hard: bool) -> None:
            """An app that ends an answer short ends the connection: with a reset (`hard`: a
            reader cut off for taking none of it, whose unsent bytes are dropped) or a close
            (the client gets what was sent, short of its Content-Length). Its cycle is told
            it is gone now, else uvicorn, finding the answer incomplete when the app returns,
            logged an error for what is no bug of the server's."""
            cycle.disconnected = True
            cycle.message_event.set()
            if not self.transport.is_closing():
                if hard:
                    self._reset_connection()
                else:
                    self.transport.close()

        def _on_send_stuck(self) -> None:
            stats.send_timeouts += 1
            self._reset_connection()  # connection_lost tells the app: its send returns at once

        def _reset_connection(self) -> None:
            """A TCP reset now (its unsent bytes dropped); no lingering close after it."""
            self._was_reset = True
            self._disarm()
            reset(self.transport)

        def on_response_complete(self) -> None:
            if self.pipeline and not self.transport.is_closing():
                self._active = self.pipeline[-1][0]  # the one uvicorn starts now
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self._pending_error is not None and not self._earlier_answers_pending():
                self._unset_keepalive_if_required()
                status, code, message = self._pending_error
                self._pending_error = None
                self._write_error_and_close(status, code, message)
                return
            self._update_receive_deadline()
            self._update_room()

        def _earlier_answers_pending(self) -> bool:
            """Are answers to requests before the one being read still to be written?"""
            current = self.cycle if self._phase == BODY else None
            cycles = [self._active] + [c for c, _ in self.pipeline]
            return any(c is not None and c is not current and not c.response_complete for c in cycles)

        # ---- reading ------------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            if self._refused is not None:
                self._refused_data(data)
                return
            if self._broken:
                return  # drained and dropped: an error is on its way
            self._unset_keepalive_if_required()
            self._last_read_at = self.loop.time()
            phase_before, message_before, data_before = self._phase, self._message_no, self._body_data
            self._heads_in_read = 0
            if self._phase == IDLE:  # a read that begins a request (upgrade_header.py)
                data = without_upgrade(data)
            elif self._phase == HEAD:  # a head goes on in this read
                data = without_upgrade(data, self._head_tail)
            self._head_tail = data[-3:]
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                # the parser stops at an upgrade it was left (a CONNECT, an Upgrade name cut
                # between reads, one pipelined behind another request: upgrade_header.py); the
                # request itself is answered (ignoring the upgrade, as RFC 9110 lets a server do),
                # then the connection is closed
                self._broken = True
                if self.cycle is not None:
                    self.cycle.keep_alive = False
                return
            except httptools.HttpParserError as exc:
                cause = exc.__context__ if isinstance(exc.__context__, Refusal) else None
                if cause is None:
                    self._refuse_request(Refusal(400, "bad_request", "invalid HTTP request", "bad_requests"))
                else:
                    self._refuse_request(cause)
                return
            self._account(len(data), phase_before, message_before, data_before)
            if not self._broken:
                self._update_receive_deadline()
                self._update_room()

        def _account(self, n: int, phase_before: str, message_before: int, data_before: int) -> None:
            """Count this read's bytes towards the head or the body they belong to (a body's
            framing apart: what the read held besides body data). When a request ended inside
            the read and the next one began, the next one's share of the read is unknown: it
            is counted from the next read on (at most one read late)."""
            if self._phase in (IDLE, HEAD):
                if phase_before in (IDLE, HEAD) and self._heads_in_read == 0:
                    self._waiting_bytes += n
                if self._waiting_bytes > limits.max_header_bytes:
                    self._refuse_request(too_large(
                        f"request line and headers are over {limits.max_header_bytes} bytes"))
            elif phase_before == BODY and self._message_no == message_before:
                self._body_bytes += n
                self._framing_bytes += n - (self._body_data - data_before)
                if framing_too_large(self._framing_bytes, self._chunks, limits.max_header_bytes):
                    self._refuse_request(too_large(
                        f"the body's chunk lines and trailer fields are over {limits.max_header_bytes} bytes"))
                elif self._body_bytes > limits.max_body_framing_bytes:
                    self._refuse_request(Refusal(
                        413, "body_too_large",
                        f"the request body took over {limits.max_body_framing_bytes} bytes on the wire",
                        "framing_too_large"))

        def send_400_response(self, msg: str) -> None:
            self._fail(400, "bad_request", msg)

        def _refuse_request(self, refusal: Refusal) -> None:
            """Stop parsing and answer ``refusal``: now, or after the answers still owed to
            earlier requests (the client reads answers in order)."""
            self._cut = True
            setattr(stats, refusal.counter, getattr(stats, refusal.counter) + 1)
            self._broken = True
            self._disarm()
            if self._phase == BODY and self.cycle is not None and not self.cycle.response_complete:
                self._drop_current_cycle()
            if self._earlier_answers_pending():
                self._pending_error = (refusal.status, refusal.code, refusal.message)
                self.flow.pause_reading()
                return
            self._fail(refusal.status, refusal.code, refusal.message)

        def _drop_current_cycle(self) -> None:
            """The request being read will not be completed: its app sees a disconnect, and a
            copy still queued behind others never starts."""
            cycle = self.cycle
            if cycle is not self._active:
                for entry in list(self.pipeline):
                    if entry[0] is cycle:
                        self.pipeline.remove(entry)
                cycle.response_complete = True  # nothing will be written for it
            cycle.disconnected = True
            cycle.message_event.set()

        def _fail(self, status: int, code: str, message: str) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            cycle = self.cycle if self._phase == BODY else None
            if cycle is None or not cycle.response_started:
                self._write_error_and_close(status, code, message)
            else:
                self.transport.close()

        def _write_error_and_close(self, status: int, code: str, message: str) -> None:
            self._broken = True
            self.transport.write(error_bytes(status, code, message))
            self.transport.close()

        # ---- parser callbacks -------------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._message_no += 1
            self._phase = HEAD
            self._head_bytes = 0
            self._header_count = 0

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > limits.max_header_count:
                raise too_large(f"over {limits.max_header_count} header fields")
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > limits.max_header_bytes:
                raise too_large(f"request line and headers are over {limits.max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            if (self.cycle is not None and not self.cycle.response_complete
                    and len(self.pipeline) >= limits.max_pipelined_requests):
                raise Refusal(429, "too_many_pipelined_requests",
                               f"over {limits.max_pipelined_requests} requests wait behind the one being answered",
                               "pipeline_refused")
            starts_now = self.cycle is None or self.cycle.response_complete
            self._phase = BODY
            self._heads_in_read += 1
            self._waiting_bytes = 0
            self._body_bytes = 0
            self._framing_bytes = 0
            self._chunks = 0
            self._body_data = 0
            super().on_headers_complete()
            self.cycle.scope.setdefault("extensions", {})[END_EXTENSION] = _ender(self, self.cycle)
            if starts_now:  # else uvicorn queued it behind the one being answered
                self._active = self.cycle
            if self.cycle.waiting_for_100_continue:
                cycle = self.cycle
                close_if_refused_before_continue(cycle)
                stamp_the_continue(cycle, lambda: cycle is self.cycle and self._body_owed_now())
            if self._overflow:  # taken beyond max_connections for this one request
                self.cycle.keep_alive = False

        def _start_asgi_task(self, cycle, app) -> None:
            """A few requests start per turn of the loop, probes at once (start_turns)."""
            self._waiting_start = PendingStart(super()._start_asgi_task, cycle, app)
            starts.start(self._waiting_start, self.loop, prompt=is_probe(cycle.scope))

        def on_chunk_header(self) -> None:
            self._chunks += 1
            if chunks_too_small(self._chunks, self._body_data, limits.min_body_chunk_bytes):
                raise Refusal(413, "body_too_fragmented",
                               f"the chunked body's chunks average under {limits.min_body_chunk_bytes} bytes",
                               "bodies_too_fragmented")

        def on_body(self, body: bytes) -> None:
            self._body_data += len(body)
            self._body_held += len(body)
            bodies.read(len(body))
            cycle = self.cycle
            if cycle.body or cycle.response_complete or self.parser.should_upgrade():
                super().on_body(body)
                return
            # The piece itself, as uvicorn's receive() hands it on (bytes() of a bytes object is
            # that object): its bytearray would copy every byte of every upload twice on the loop.
            cycle.body = body
            if len(body) > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            cycle.message_event.set()

        def _let_go_of_body(self) -> None:
            if self._body_held:
                bodies.let_go(self._body_held)
                self._body_held = 0

        def on_message_complete(self) -> None:
            self._let_go_of_body()
            self._phase = IDLE
            if self._body_rate is not None:
                self._body_rate.stop()
            super().on_message_complete()

    GuardedHttpProtocol.admission = admission
    GuardedHttpProtocol.lingering = lingering  # shared by its connections: seen by /metrics and tests
    GuardedHttpProtocol.starts = starts
    GuardedHttpProtocol.bodies = bodies
    return GuardedHttpProtocol

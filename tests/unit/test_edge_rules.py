"""The HTTP edge's rules on their own, with an injected clock: which connection makes room at
max_connections, a body's minimum rate (and the time that is not the client's), tiny chunks,
and JSON items counted before parsing (the service routes and the jobs envelope alike)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from services.jobs.payload import Limits, digest_submit
from services.runtime.edge.body_pace import CHUNK_GRACE, BodyRate, chunks_too_small
from services.runtime.edge.connection_room import STALLED_ANSWER_S, ConnectionRoom
from services.runtime.edge.json_items import JsonItemCounter, check_json_items, nests_deeper_than, structural_bytes
from services.runtime.errors import ApiError


# ---- connection room ---------------------------------------------------------------------------
class Conn:
    def __init__(self, name: str, closed: list[str]):
        self.name, self.closed = name, closed
        self.unread: float | None = 0.0  # since when its client took nothing of its answer

    def give_way(self) -> None:
        self.closed.append(self.name)

    def unread_since(self) -> float | None:
        return self.unread


def room_of(limit: int) -> tuple[ConnectionRoom, list[str], dict[str, Conn]]:
    """A room whose connections were listed 10 s before make_room's time (0): none is fresh."""
    closed: list[str] = []
    return ConnectionRoom(limit, clock=lambda: -10.0), closed, {}


def test_the_longest_idle_connection_makes_room_before_an_arriving_head():
    room, closed, c = room_of(3)
    for name in ("a", "b", "c"):
        c[name] = Conn(name, closed)
    room.no_request(c["a"])   # accepted, nothing sent yet
    room.arriving(c["b"])     # a head arriving
    room.no_request(c["c"])
    room.no_request(c["a"])   # answered and kept alive: idle from now, so behind c
    assert room.make_room(3) and closed == ["c"]
    # c is still open until its close completes: 4 open, c leaving, counted once
    assert room.make_room(4) and closed == ["c", "a"]
    assert room.make_room(5) and closed == ["c", "a", "b"]  # no idle one left: the oldest head


class SocketTransport:
    """What the room reads of a transport: its socket (a real one: FIONREAD is asked)."""

    def __init__(self, sock):
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


@contextlib.contextmanager
def socket_pairs(n: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """n connected socket pairs (ours, theirs), all closed at the end, whatever happens."""
    pairs = [socket.socketpair() for _ in range(n)]
    try:
        yield pairs
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


class SlotWriter(SocketTransport):
    """A stream writer as the supervisor's slots see it: its socket, and an abort that is noted."""

    def __init__(self, sock, aborted: list):
        super().__init__(sock)
        self.transport = type("T", (), {"abort": lambda _self: aborted.append(self)})()


def test_an_idle_connection_whose_request_arrived_unread_is_not_the_one_closed():
    """On a busy loop a probe's connection is accepted before its request is read: when the
    room is full, the one that really sent nothing gives way, not the one with bytes waiting."""

    room, closed, c = room_of(2)
    with socket_pairs(2) as pairs:
        for name, (ours, _) in zip("ab", pairs, strict=True):
            c[name] = Conn(name, closed)
            c[name].transport = SocketTransport(ours)
            room.no_request(c[name])
        pairs[0][1].sendall(b"GET /healthz HTTP/1.1\r\n\r\n")  # a's request, in its socket, unread
        assert room.make_room(2) and closed == ["b"]


def test_the_supervisors_slots_spare_a_connection_whose_request_arrived_unread():
    from supervisor.servers.connection_slots import Slots

    aborted: list = []
    with socket_pairs(3) as pairs:
        slots = Slots(2, fresh_s=0.0)  # order alone decides here
        a, b, newcomer = (SlotWriter(ours, aborted) for ours, _ in pairs)
        assert slots.admit(a) and slots.admit(b)
        pairs[0][1].sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert slots.admit(newcomer) and aborted == [b]


def test_the_supervisors_slots_never_close_a_fresh_connection_to_make_room():
    """A probe's client descheduled between its connect and its send looks silent: while it
    is under FRESH_S old it keeps its place, and a silent newcomer is the one turned away."""

    from supervisor.servers.connection_slots import FRESH_S, Slots

    now = [100.0]
    aborted: list = []
    with socket_pairs(4) as pairs:
        slots = Slots(2, clock=lambda: now[0])
        a, b, newcomer, later = (SlotWriter(ours, aborted) for ours, _ in pairs)
        assert slots.admit(a)
        now[0] += FRESH_S / 2
        assert slots.admit(b)
        assert not slots.admit(newcomer) and aborted == []  # both fresh
        now[0] += FRESH_S / 2
        assert slots.admit(later) and aborted == [a]        # a has settled; b is still fresh
        assert slots.closed_early == 1


def test_a_newcomer_with_its_whole_request_is_answered_beyond_a_full_fresh_port():
    from supervisor.servers.connection_slots import OVERFLOW, Slots

    aborted: list = []
    with socket_pairs(OVERFLOW + 4) as pairs:
        slots = Slots(2, clock=lambda: 0.0)
        writers = [SlotWriter(ours, aborted) for ours, _ in pairs]
        assert slots.admit(writers[0]) and slots.admit(writers[1])
        for _, theirs in pairs[2:]:
            theirs.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        taken = [slots.admit(w) for w in writers[2:]]
        assert taken == [True] * OVERFLOW + [False] * 2 and aborted == []  # beyond, up to OVERFLOW
        slots.leave(writers[2])
        assert slots.admit(writers[-1])  # one answered and gone: room beyond again


def test_a_newcomer_refused_for_room_is_taken_when_its_request_comes_late():
    """The late wait reads the newcomer's own data: the request that comes within LATE_S is
    handed back to be answered, the silent newcomer is closed after LATE_S."""
    import asyncio

    from supervisor.servers.connection_slots import LATE_S, Slots

    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"

    async def scenario() -> tuple[bytes | None, bytes | None, int]:
        loop = asyncio.get_running_loop()
        aborted: list = []
        with socket_pairs(4) as pairs:
            slots = Slots(2)
            a, b, late, silent = (SlotWriter(ours, aborted) for ours, _ in pairs)
            assert slots.admit(a) and slots.admit(b)
            assert not slots.admit(late) and not slots.admit(silent)
            for ours, _ in pairs[2:]:
                ours.setblocking(False)
            loop.call_later(LATE_S / 4, pairs[2][1].sendall, request)
            got_late = await slots.admit_late(late, lambda: loop.sock_recv(pairs[2][0], 4096))
            got_silent = await slots.admit_late(silent, lambda: loop.sock_recv(pairs[3][0], 4096))
            return got_late, got_silent, slots.closed_early

    # the silent one is closed after LATE_S
    assert asyncio.run(scenario()) == (request, None, 1)


def test_past_the_bound_of_late_newcomers_the_one_waiting_longest_is_closed_not_the_newest():
    """Silent clients fill every slot and every late wait: a probe that connects, then sends
    a moment later, still waits for its request (the silent one waiting longest is closed in
    its stead) and is answered; refused at once, it was a probe failure."""
    import asyncio

    from supervisor.servers.connection_slots import LATE_PER_SLOT, LATE_S, Slots

    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    silent_n = LATE_PER_SLOT * 2

    async def scenario() -> tuple[list, bytes | None, int]:
        loop = asyncio.get_running_loop()
        aborted: list = []
        with socket_pairs(2 + silent_n + 1) as pairs:
            slots = Slots(2, clock=lambda: 0.0)  # every slot fresh: none is closed to make room
            writers = [SlotWriter(ours, aborted) for ours, _ in pairs]
            assert slots.admit(writers[0]) and slots.admit(writers[1])
            for ours, _ in pairs[2:]:
                ours.setblocking(False)
            waits = []
            for i in range(2, 2 + silent_n):  # the late waits, all taken by silent clients
                assert not slots.admit(writers[i])
                waits.append(asyncio.ensure_future(
                    slots.admit_late(writers[i], lambda i=i: loop.sock_recv(pairs[i][0], 4096))))
                await asyncio.sleep(0.01)  # an order of arrival
            probe = writers[-1]
            assert not slots.admit(probe)
            loop.call_later(LATE_S / 5, pairs[-1][1].sendall, request)
            got = await slots.admit_late(probe, lambda: loop.sock_recv(pairs[-1][0], 4096))
            first_done = [w.done() for w in waits]
            await asyncio.gather(*waits)
            return first_done, got, slots.closed_early

    first_done, got, closed = asyncio.run(scenario())
    assert got == request
    assert first_done == [True] + [False] * (silent_n - 1), first_done  # the oldest went, at once
    assert closed == silent_n  # every silent one, in the end


def test_late_newcomers_whose_requests_are_in_still_count_toward_the_bound():
    """Every slot and place beyond taken, newcomers with whole requests wait for room: past
    LATE_PER_SLOT x limit of them the next is closed at once. Closing the longest waiter
    without looking took them off the count, and 40 waited at once with a bound of 4."""
    import asyncio

    from supervisor.servers.connection_slots import LATE_PER_SLOT, OVERFLOW, Slots

    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    newcomers = 40

    async def scenario() -> tuple[int, list]:
        loop = asyncio.get_running_loop()
        aborted: list = []
        with socket_pairs(1 + OVERFLOW + newcomers) as pairs:
            slots = Slots(1, clock=lambda: 0.0)
            writers = [SlotWriter(ours, aborted) for ours, _ in pairs]
            for _, theirs in pairs:
                theirs.sendall(request)
            assert slots.admit(writers[0])
            slots.working(writers[0])
            assert all(slots.admit(w) for w in writers[1:1 + OVERFLOW])  # the places beyond, all taken
            waiting, peak = [0], [0]

            async def late(i: int):
                pairs[i][0].setblocking(False)
                waiting[0] += 1
                peak[0] = max(peak[0], waiting[0])
                try:
                    return await slots.admit_late(writers[i], lambda: loop.sock_recv(pairs[i][0], 4096))
                finally:
                    waiting[0] -= 1
            tasks = []
            for i in range(1 + OVERFLOW, 1 + OVERFLOW + newcomers):
                tasks.append(asyncio.ensure_future(late(i)))
                await asyncio.sleep(0.005)  # one after another: each one's request is read before the next
            got = await asyncio.gather(*tasks)
            return peak[0], got

    peak, got = asyncio.run(scenario())
    assert got == [None] * newcomers  # no room came: every one closed, at its deadline or at once
    assert peak <= LATE_PER_SLOT * 1 + 1, peak  # (+1: the newcomer being closed at once, counted here)


def test_a_late_newcomer_whose_request_is_in_waits_for_room_until_its_deadline():
    """A burst of whole probes fills the places beyond the limit: one more, late, is taken
    when an answered one leaves (answers are quick), not refused at once."""
    import asyncio

    from supervisor.servers.connection_slots import LATE_S, OVERFLOW, Slots

    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"

    async def scenario() -> tuple[bytes | None, bytes | None]:
        loop = asyncio.get_running_loop()
        aborted: list = []
        with socket_pairs(2 + OVERFLOW + 2) as pairs:
            slots = Slots(2, clock=lambda: 0.0)
            writers = [SlotWriter(ours, aborted) for ours, _ in pairs]
            for _, theirs in pairs:
                theirs.sendall(request)
            for w in writers[:2]:
                assert slots.admit(w)
                slots.working(w)
            assert all(slots.admit(w) for w in writers[2:2 + OVERFLOW])  # the places beyond, all taken
            late, too_late = writers[-2], writers[-1]
            assert not slots.admit(late) and not slots.admit(too_late)
            for ours, _ in pairs[-2:]:
                ours.setblocking(False)
            loop.call_later(LATE_S / 4, slots.leave, writers[2])  # one answered, gone
            return await asyncio.gather(
                slots.admit_late(late, lambda: loop.sock_recv(pairs[-2][0], 4096)),
                slots.admit_late(too_late, lambda: asyncio.sleep(LATE_S / 2, b"GET / HTTP/1.1\r\n\r\n")))

    # the first takes the place that came free; the second finds none before its deadline
    assert asyncio.run(scenario()) == [request, None]


def test_a_connection_with_a_request_in_progress_never_makes_room():
    room, closed, c = room_of(2)
    for name in ("a", "b"):
        c[name] = Conn(name, closed)
        room.arriving(c[name])
        room.busy(c[name])
    assert not room.make_room(2) and closed == []
    room.gone(c["a"])
    assert room.make_room(1)  # below the limit: nothing to close


def test_an_answer_its_client_takes_nothing_of_makes_room_only_after_a_while():
    """helper-53: 700 clients asking for a job's result and never reading held every place
    until the send deadline; every other reader got 503 too_many_connections."""
    room, closed = ConnectionRoom(3, clock=lambda: 0.0), []
    a, b, c = Conn("a", closed), Conn("b", closed), Conn("c", closed)
    room.busy(a)
    room.answer_unread(b, 0.0)
    assert not room.make_room(3, now=STALLED_ANSWER_S - 0.1) and closed == []  # not long enough
    b.unread = None  # its client took some since, unbeknown to the room: not closed, no longer listed
    assert not room.make_room(3, now=STALLED_ANSWER_S + 0.1) and closed == []
    assert room.counts()["unread"] == 0
    room.answer_unread(b, 5.0)
    room.answer_unread(b, 6.0)  # still waiting: its first time stands
    room.answer_unread(c, 5.5)
    b.unread, c.unread = 6.5, 5.5  # b's slow client took some at 6.5; c's nothing since 5.5
    assert room.make_room(3, now=5.0 + STALLED_ANSWER_S + 0.6) and closed == ["c"]  # b, listed first, stays
    room.gone(c)
    assert room.counts()["unread"] == 1
    room.busy(b)  # taking its answer again: in progress, never closed
    assert not room.make_room(3, now=60.0) and closed == ["c"]


def test_an_arriving_head_keeps_its_place_and_a_leaving_one_is_not_listed_again():
    room, closed, c = room_of(2)
    for name in ("a", "b"):
        c[name] = Conn(name, closed)
        room.arriving(c[name])
    room.arriving(c["a"])  # more of a's head: still the oldest
    assert room.make_room(2) and closed == ["a"]
    room.no_request(c["a"])  # a late event from the one leaving
    assert room.make_room(3) and closed == ["a", "b"]
    room.gone(c["a"])
    room.gone(c["b"])
    assert room.counts() == {"idle": 0, "arriving": 0, "bodies": 0, "unread": 0, "leaving": 0}


# ---- a body's rate ---------------------------------------------------------------------------
class FakeLoop:
    """call_later and time() on a clock the test moves."""

    def __init__(self):
        self.now = 0.0
        self.timers: list[tuple[float, object]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay, fn):
        handle = Handle(self.now + delay, fn)
        self.timers.append(handle)
        return handle

    def advance(self, seconds: float, step: float = 0.25) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + step)
            for h in [h for h in self.timers if h.when <= self.now and not h.cancelled]:
                self.timers.remove(h)
                h.fn()


class Handle:
    def __init__(self, when, fn):
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self):
        self.cancelled = True


def watch(min_rate=1000, grace_s=3.0):
    loop, state = FakeLoop(), {"bytes": 0, "waits": False, "cut": 0}
    rate = BodyRate(loop, min_rate, grace_s, lambda: state["bytes"], lambda: state["waits"],
                    lambda: state.__setitem__("cut", state["cut"] + 1))
    return loop, state, rate


def test_a_body_below_the_minimum_rate_is_cut_once_the_grace_has_passed():
    loop, state, rate = watch()
    rate.start()
    loop.advance(2.5)
    state["bytes"] = 100  # 100 bytes in 2.5 s: under 1000/s, but within the grace
    assert state["cut"] == 0
    loop.advance(1.0)
    assert state["cut"] == 1
    loop.advance(5.0)
    assert state["cut"] == 1  # told once


def test_a_body_at_the_rate_is_never_cut_and_a_slow_start_is_averaged():
    loop, state, rate = watch()
    rate.start()
    for _ in range(20):  # nothing for a second, then 4000 bytes a second: over 1000/s averaged from the start
        loop.advance(1.0)
        state["bytes"] += 0 if loop.now <= 1.0 else 4000
    assert state["cut"] == 0
    rate.stop()
    loop.advance(10.0)
    assert state["cut"] == 0


def test_time_the_service_holds_the_body_back_does_not_count():
    loop, state, rate = watch()
    rate.start()
    state["waits"] = True  # reading paused (the app has not taken what came) or a 100 Continue due
    loop.advance(10.0)
    assert state["cut"] == 0
    state["waits"] = False
    loop.advance(2.0)
    assert state["cut"] == 0  # a new grace from the end of the pause
    loop.advance(2.0)
    assert state["cut"] == 1


def test_a_minimum_rate_of_zero_watches_nothing():
    loop, state, rate = watch(min_rate=0)
    rate.start()
    loop.advance(60.0)
    assert state["cut"] == 0 and loop.timers == []


# ---- chunks --------------------------------------------------------------------------------------
def test_tiny_chunks_are_refused_only_after_the_grace_and_on_average():
    assert not chunks_too_small(CHUNK_GRACE, CHUNK_GRACE, 1024)            # 1-byte chunks, still in the grace
    assert chunks_too_small(CHUNK_GRACE + 1, CHUNK_GRACE, 1024)            # one more: refused
    assert not chunks_too_small(5000, 4999 * 1024, 1024)                  # 1 KiB chunks: fine
    assert chunks_too_small(5000, 4999 * 1024 - 1, 1024)
    assert not chunks_too_small(10**6, 0, 0)                              # 0: no minimum


# ---- JSON items ----------------------------------------------------------------------------------
def test_items_are_counted_by_structural_bytes_and_bound_what_json_builds():
    doc = {"a": [1, 2, {"b": []}], "c": "x"}
    raw = json.dumps(doc).encode()
    assert structural_bytes(raw) == 7  # { [ , , { [ and the comma between a and c
    check_json_items(raw, 7)
    with pytest.raises(ApiError) as exc:
        check_json_items(raw, 6)
    assert (exc.value.status, exc.value.code) == (413, "json_too_complex")


def test_items_counted_piece_by_piece_are_refused_at_the_piece_past_the_limit():
    counter = JsonItemCounter(10)
    body = b"[" + b"[]," * 20 + b"[]]"
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]
    fed = 0
    with pytest.raises(ApiError) as exc:
        for piece in pieces:
            counter.feed(piece)
            fed += 1
    assert exc.value.code == "json_too_complex" and exc.value.headers == {"Connection": "close"}
    assert fed < len(pieces) - 1  # refused long before the end


def test_the_jobs_envelope_is_counted_before_it_is_parsed():
    raw = json.dumps({"service": "detect", "route": "/api/v1/facedetect", "image": "AAAA",
                      "params": {"x": [[]] * 200}}).encode()
    refused = digest_submit(raw, 33, Limits(10**6, 10**6), 100)
    assert refused.error is not None and refused.error[:2] == (413, "json_too_complex"), refused.error
    assert not refused.parsed
    parsed = digest_submit(raw, 33, Limits(10**6, 10**6), 10_000)
    assert parsed.error is None or parsed.error[1] != "json_too_complex"


def test_a_deep_document_past_the_items_limit_is_too_deep_not_too_complex():
    """The same class of body gets the same answer: 40 000 nested brackets are refused by the
    item count, and answered as the depth limit answers a small deep document."""
    deep = b'{"a": ' + b"[" * 40_000 + b"]" * 40_000 + b"}"
    with pytest.raises(ApiError) as exc:
        check_json_items(deep, 10_000, 16)
    assert (exc.value.status, exc.value.code) == (400, "json_too_deep")
    counter = JsonItemCounter(10_000, 16)
    with pytest.raises(ApiError) as exc:
        for i in range(0, len(deep), 4096):
            counter.feed(deep[i:i + 4096], deep[:i])
    assert (exc.value.status, exc.value.code) == (400, "json_too_deep")
    flat = b"[" + b"[]," * 20_000 + b"[]]"  # wide, two levels: too complex, not too deep
    with pytest.raises(ApiError) as exc:
        check_json_items(flat, 10_000, 16)
    assert (exc.value.status, exc.value.code) == (413, "json_too_complex")
    assert not nests_deeper_than(b'["[[[[[[[[[[", "\\"[[[["]', 1)  # brackets in strings are text
    assert nests_deeper_than(b'{"a":' * 17, 16)  # the start of a document: what is open counts
    assert not nests_deeper_than(b'{"image": "x", "x": [[],[],[', 16)  # a wide one cut anywhere is shallow
    prefix = b'{"image": "AAAA", "x": [' + b"[]," * 30_000  # the tiny-containers attack, cut mid-way
    with pytest.raises(ApiError) as exc:
        JsonItemCounter(10_000, 32).feed(prefix[100:], prefix[:100])
    assert (exc.value.status, exc.value.code) == (413, "json_too_complex")


# ---- lingering close ----------------------------------------------------------------------------
def test_a_lingering_socket_drops_what_arrives_and_the_oldest_makes_room_for_a_newer_one():
    """Real sockets: a closed connection with unread bytes lingers (its side shut, what the
    client sends read and dropped); at the limit the one lingering longest is closed for the
    newcomer, whose client must still get its answer instead of a reset."""
    import asyncio
    import socket

    from services.runtime.edge.lingering_close import LingeringClose

    async def scenario():
        loop = asyncio.get_running_loop()
        lingering = LingeringClose(limit=1, idle_s=30)
        with socket_pairs(2) as pairs:
            for _ours, theirs in pairs:
                theirs.sendall(b"x" * 1000)  # a body the service never read
                await asyncio.sleep(0.01)
            assert lingering.adopt(loop, pairs[0][0]) and lingering.count == 1
            pairs[0][0].close()  # the connection's own descriptor goes; the socket lingers
            pairs[0][1].sendall(b"y" * 200_000)  # more body: drained, never a reset
            await asyncio.sleep(0.05)
            assert lingering.drained_bytes >= 1000
            assert lingering.adopt(loop, pairs[1][0]) and lingering.count == 1 and lingering.cut_short == 1
            pairs[1][0].close()
            pairs[0][1].settimeout(2)
            assert pairs[0][1].recv(10) == b""  # the oldest was closed to make room (its side shut first)
            pairs[1][1].shutdown(socket.SHUT_WR)  # the newer client is done sending: it lingers until then
            await asyncio.sleep(0.05)
            assert lingering.count == 0

    asyncio.run(scenario())


def test_a_connection_the_edge_cut_lingers_only_briefly():
    """A client the edge cut (a body too slow) and still sending gets its answer instead of a
    reset, so its socket lingers too; but only for CUT_TOTAL_S however much it sends, where a
    refused request's socket lingers on while its client keeps sending."""
    import asyncio
    import socket
    import time

    from services.runtime.edge import lingering_close
    from services.runtime.edge.lingering_close import LingeringClose

    async def scenario():
        loop = asyncio.get_running_loop()
        lingering = LingeringClose(limit=4, idle_s=30, total_s=60)
        cut, kept = socket.socketpair(), socket.socketpair()
        try:
            for _ours, theirs in (cut, kept):
                theirs.sendall(b"x" * 1000)
                await asyncio.sleep(0.01)
            assert lingering.adopt(loop, cut[0], body_unfinished=True, cut=True)
            assert lingering.adopt(loop, kept[0], body_unfinished=True)
            cut[0].close()
            kept[0].close()
            t0 = time.monotonic()
            while time.monotonic() - t0 < lingering_close.CUT_TOTAL_S + 1.5:  # both clients keep sending
                for _, theirs in (cut, kept):
                    try:
                        theirs.send(b"y" * 100)
                    except OSError:
                        pass
                await asyncio.sleep(0.2)
            assert lingering.count == 1  # the cut one is closed; the other still drains
            cut[1].settimeout(2)
            assert cut[1].recv(10) == b""  # closed
        finally:
            for ours, theirs in (cut, kept):
                ours.close()
                theirs.close()

    asyncio.run(scenario())


def test_a_connection_that_made_room_lingers_while_its_client_sends_and_goes_when_it_is_silent():
    """Closed to make room for a newcomer (quiet): a silent client's socket goes after
    CUT_IDLE_S (a flood of silent connections held 40 descriptors for a client's 5 s); one
    still sending its head is read on past CUT_TOTAL_S, so that it reads its 503."""
    import asyncio
    import socket
    import time

    from services.runtime.edge import lingering_close
    from services.runtime.edge.lingering_close import LingeringClose

    async def scenario():
        loop = asyncio.get_running_loop()
        lingering = LingeringClose(limit=4, idle_s=30, total_s=60)
        silent, sending = socket.socketpair(), socket.socketpair()
        try:
            for _ours, theirs in (silent, sending):
                theirs.sendall(b"POST / HTTP/1.1\r\n")
                await asyncio.sleep(0.01)
            assert lingering.adopt(loop, silent[0], quiet=True)
            assert lingering.adopt(loop, sending[0], quiet=True)
            silent[0].close()
            sending[0].close()
            t0 = time.monotonic()
            while time.monotonic() - t0 < lingering_close.CUT_TOTAL_S + 1.5:
                sending[1].send(b"X-A: b\r\n")
                await asyncio.sleep(0.2)
            assert lingering.count == 1  # the silent one is gone, the sender still read
            silent[1].settimeout(2)
            assert silent[1].recv(10) == b""
        finally:
            for ours, theirs in (silent, sending):
                ours.close()
                theirs.close()

    asyncio.run(scenario())


def test_the_depth_scan_is_linear_in_a_string_left_open():
    """256 KiB of \\" pairs in a string never closed, then enough commas to be refused: a
    pattern retried from every quote takes minutes here (9 s for 64 KB froze a service's
    loop); the scan must end. Run apart, so that a regression fails instead of hanging."""
    import subprocess
    import sys

    code = ("from services.runtime.edge.json_items import JsonItemCounter\n"
            "from services.runtime.errors import ApiError\n"
            "body = b'[\"' + b'\\\\\"' * 131072 + b',' * 10001\n"
            "try:\n    JsonItemCounter(10000, 32).feed(body)\nexcept ApiError as e:\n    print(e.code)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=str(__import__("tests.harness", fromlist=["ROOT"]).ROOT))
    assert done.stdout.strip() == "json_too_complex", done.stderr


def test_lingering_sockets_drain_no_faster_than_the_drain_rate_and_the_client_still_finishes():
    """Real sockets: a client that keeps sending after its answer is read no faster than the
    shared drain rate (draining 4 GB/s of refused bodies took half of a loop's time), is not
    taken for silent while its reads are put off, and its connection still ends cleanly once
    it stops sending."""
    import asyncio
    import socket
    import threading
    import time

    from services.runtime.edge.lingering_close import DrainRate, LingeringClose

    rate, burst = 1 << 20, 1 << 20

    async def scenario():
        loop = asyncio.get_running_loop()
        lingering = LingeringClose(limit=4, idle_s=0.02, total_s=60)  # idle shorter than a pause
        lingering.drain_rate = DrainRate(rate, burst)
        ours, theirs = socket.socketpair()
        sent, failed = [0], []

        def client():  # sends as fast as the socket takes it for 1.5 s
            theirs.settimeout(5)
            end = time.monotonic() + 1.5
            chunk = b"z" * 65536
            try:
                while time.monotonic() < end:
                    sent[0] += theirs.send(chunk)
                theirs.shutdown(socket.SHUT_WR)
            except OSError as exc:  # closed under it: taken for gone while it was sending
                failed.append(exc)
        try:
            ours.sendall(b"HTTP/1.1 413 \r\n\r\n")  # the answer, waiting in the client's queue
            theirs.sendall(b"x" * 1000)
            assert lingering.adopt(loop, ours, body_unfinished=True)
            ours.close()
            t0 = time.monotonic()
            th = threading.Thread(target=client)
            th.start()
            while th.is_alive():
                await asyncio.sleep(0.05)
                assert lingering.drained_bytes <= burst + rate * (time.monotonic() - t0) + (1 << 20)
            th.join()
            assert not failed and lingering.paused > 0  # put off, never dropped as idle
            deadline = time.monotonic() + 30
            while lingering.count and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert lingering.count == 0 and lingering.drained_bytes >= sent[0]  # it ran to the client's end
            assert theirs.recv(100).startswith(b"HTTP/1.1 413")  # the answer, not a reset
        finally:
            ours.close()
            theirs.close()

    asyncio.run(scenario())


def test_the_quick_depth_bound_agrees_with_the_running_sum():
    """nests_deeper_than peels innermost pairs before it sums: on random documents (strings,
    escapes, cut anywhere) its answer is the running sum's at every depth limit."""
    import itertools
    import random

    from services.runtime.edge import json_items as J

    def by_sum(data: bytes, depth: int) -> bool:
        b = J._STRING.sub(b"", data[:J.DEPTH_SCAN_MAX]).translate(None, J._BRACKETS_ONLY)
        return bool(b) and max(itertools.accumulate(map(J._STEP.__getitem__, b))) > depth

    rng = random.Random(7)
    parts = [b"[", b"]", b"{", b"}", b",", b'"a[b"', b"1", b'"\\"["', b"[]", b"[[]]"]
    for _ in range(20_000):
        doc = b"".join(rng.choice(parts) for _ in range(rng.randint(0, 50)))
        for depth in (1, 2, 3, 5, 9, 32):
            assert nests_deeper_than(doc, depth) == by_sum(doc, depth), (doc, depth)
    wide = b"[" + b"[]," * 30_000          # the refused stream's shape: one pass decides it
    assert not nests_deeper_than(wide, 32) and nests_deeper_than(b"[" * 33, 32)


def test_the_drain_rate_comes_from_the_settings():
    from services.runtime.edge.connection_limits import limits_from_settings
    from services.runtime.edge.protocol import guarded_protocol
    from services.runtime.settings import ServiceSettings

    limits = limits_from_settings(ServiceSettings(lingering_drain_bytes_s=3 << 20), fds=4096)
    assert limits.lingering_drain_bytes_s == 3 << 20
    assert guarded_protocol(limits).lingering.drain_rate.rate == 3 << 20
    assert limits_from_settings(ServiceSettings(), fds=4096).lingering_drain_bytes_s == 256 << 20


class HeldTransport:
    """A refused newcomer's transport: what was written, half-closed, paused, closed."""

    def __init__(self):
        self.written, self.eof, self.closed, self.paused = b"", False, False, False

    def write(self, data: bytes) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str):
        return None


class ResetTransport(HeldTransport):
    """What a refused newcomer's transport does when its client reset the connection between
    the 503's write and the half-close: shutdown() fails with ENOTCONN (seen 512 times in a
    storm of clients that connect, send and reset)."""

    def write_eof(self) -> None:
        import errno
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")


def test_a_newcomer_refused_after_its_client_reset_the_connection_is_closed_without_an_error():
    """The failed half-close must not raise out of connection_made (the half-built protocol
    then parsed the request and ran the app: a traceback each), and the connection keeps no
    lingering slot it never used (the count leaked: after 512, no refusal lingered again)."""
    import asyncio

    from services.runtime.edge import connection_room
    from services.runtime.edge.connection_room import RefusedNewcomer

    loop = asyncio.new_event_loop()
    try:
        before = connection_room._lingering[0]
        transport = ResetTransport()
        refused = RefusedNewcomer(loop, transport, 8, pace_s=0.0)
        loop.run_until_complete(asyncio.sleep(0.01))  # its paced 503
        assert transport.closed and b"too_many_connections" in transport.written
        refused.gone()
        assert connection_room._lingering[0] == before
    finally:
        loop.close()


@pytest.mark.parametrize("data,whole", [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", True),
    (b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", True),
    (b"POST /a HTTP/1.1\r\nContent-Length: 4\r\n\r\nabc", False),                  # body still to come
    (b"POST /a HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n", False),  # waits for a 100
    (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", False),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", False),                                   # head unfinished
    (b"POST /a HTTP/1.1\r\nContent-Length: 0000000000003\r\n\r\nabc", True),          # zeros: still 3
    (b"POST /a HTTP/1.1\r\nContent-Length: 00000000000100\r\n\r\nabc", False),        # 100, not 0
    (b"POST /a HTTP/1.1\r\nContent-Length: x3\r\n\r\nabc", False),                    # not a number
    (b"GET / HTTP/1.1\r\n\r\nPOST /a HTTP/1.1\r\nContent-Length: 9\r\n\r\n", False),  # a second behind it
    (b"", False),
])
def test_a_whole_request_is_one_with_nothing_more_to_wait_for(data, whole):
    from services.runtime.edge.connection_room import whole_request
    assert whole_request(data) is whole


def test_a_full_room_takes_a_newcomer_with_a_whole_request_within_its_overflow_only():
    room, closed, c = room_of(8)
    for name in "abcdefgh":
        c[name] = Conn(name, closed)
        room.busy(c[name])
    assert not room.make_room(8, 0.0, lambda: False)  # its request is not in yet: refused
    assert room.make_room(8, 0.0, lambda: True)       # a probe: answered beyond the limit
    assert room.make_room(15, 0.0, lambda: True)      # up to 8 beyond (an eighth of the limit, at least 8)
    assert not room.make_room(16, 0.0, lambda: True) and closed == []
    # a probe may also take the reserve beyond the overflow: clients' whole requests filled it
    from services.runtime.edge.connection_room import PROBE, PROBE_RESERVE, WHOLE
    assert room.make_room(16, 0.0, lambda: PROBE) and not room.make_room(16, 0.0, lambda: WHOLE)
    assert room.make_room(15 + PROBE_RESERVE, 0.0, lambda: PROBE)
    assert not room.make_room(16 + PROBE_RESERVE, 0.0, lambda: PROBE) and closed == []


@pytest.mark.parametrize("data,kind", [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 2),
    (b"GET /readyz HTTP/1.1\r\n\r\n", 2),
    (b"GET /healthz?x=1 HTTP/1.1\r\n\r\n", 1),   # not a probe's path: a whole request
    (b"POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 1),
    (b"GET /v1/jobs/1 HTTP/1.1\r\n\r\n", 1),
    (b"GET /healthz HTTP/1.1\r\n", 0),               # its head unfinished
])
def test_a_probe_is_a_whole_get_of_a_probes_path(data, kind):
    from services.runtime.edge.connection_room import request_kind
    assert request_kind(data) == kind



def test_waiting_bytes_are_peeked_and_left_for_the_reader():
    import socket

    from common.socket_queues import waiting_bytes
    ours, theirs = socket.socketpair()
    try:
        assert waiting_bytes(ours.fileno(), 100) == b""
        theirs.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert waiting_bytes(ours.fileno(), 5) == b"GET /"
        assert ours.recv(100) == b"GET /healthz HTTP/1.1\r\n\r\n"  # still there, and the socket still open
    finally:
        ours.close()
        theirs.close()


def test_a_connection_idle_for_a_moment_never_makes_room():
    """A probe accepted before its request is read is idle for a moment: a stalled body or one
    idle for FRESH_S makes room, never the fresh connection (a chain of evictions closed the
    probe's without an answer)."""
    from services.runtime.edge.connection_room import FRESH_S, STALLED_BODY_S

    clock = FakeLoop()
    room = ConnectionRoom(3, clock=clock.time)
    closed: list[str] = []
    c = {name: Conn(name, closed) for name in ("body", "other", "probe", "old")}
    for conn in c.values():
        conn.owes_body = lambda: True
    room.body_arriving(c["body"], last_read=clock.now)
    room.busy(c["other"])
    clock.now += STALLED_BODY_S + 0.1
    room.no_request(c["probe"])  # just accepted, its bytes not in yet
    assert room.make_room(3, clock.now) and closed == ["body"]
    room.gone(c["body"])
    room.no_request(c["old"])    # a kept-alive one, idle from now on
    clock.now += FRESH_S
    room.no_request(c["probe"])  # answered and kept alive just now: fresh again
    assert room.make_room(3, clock.now) and closed == ["body", "old"]  # idle for FRESH_S: it goes
    # nothing else: the newcomer is refused, the fresh one kept (it may be a probe's)
    assert not room.make_room(4, clock.now) and closed == ["body", "old"]


def test_a_refused_newcomer_is_answered_after_a_pause_and_a_late_whole_request_is_taken():
    """Its 503 waits PACE_S (a client answered at once reconnects at once); a whole request
    that arrives meanwhile is offered to the room, and once taken nothing is written."""
    from services.runtime.edge import connection_room
    from services.runtime.edge.connection_room import BEGUN, LINGER_S, PACE_S, WHOLE, RefusedNewcomer

    loop, before = FakeLoop(), connection_room._lingering[0]
    refused = RefusedNewcomer(loop, transport := HeldTransport(), 8)
    assert transport.written == b"" and connection_room._lingering[0] == before + 1
    loop.advance(PACE_S[0] - 0.1, step=0.05)
    assert transport.written == b""
    loop.advance(PACE_S[1] - PACE_S[0] + 0.1, step=0.05)
    assert b"503" in transport.written and b"too_many_connections" in transport.written and transport.eof
    assert not transport.closed
    loop.advance(LINGER_S + 0.1)
    assert transport.closed  # the lingering close
    refused.gone()
    assert connection_room._lingering[0] == before

    offered: list[bytes] = []
    taken = RefusedNewcomer(loop, transport := HeldTransport(), 8,
                            take_late=lambda data: offered.append(data) or len(offered) > 1, pace_s=1.0)
    assert taken.waits_with() == 0 and not taken.offer()  # nothing sent: nothing to take
    taken.data_received(b"GET /v1/x HTTP/1.1\r\n")
    assert taken.waits_with() == BEGUN
    taken.data_received(b"Host: x\r\n\r\n")
    assert taken.waits_with() == WHOLE and offered == []  # offered by the line, in its turn
    assert not taken.offer() and offered == [b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n"]  # no room
    assert taken.offer() and len(offered) == 2 and connection_room._lingering[0] == before  # taken: uncounted
    loop.advance(2.0)
    assert transport.written == b"" and not transport.closed

    # an upload's first bytes are kept (a head's worth, the rest left in the socket) for its turn
    big = RefusedNewcomer(loop, transport := HeldTransport(), 8, take_late=offered.append, pace_s=1.0)
    head = b"POST /a HTTP/1.1\r\nContent-Length: 99999\r\n\r\n"
    big.data_received(head + b"x" * 20000)
    assert transport.paused and big.waits_with() == BEGUN
    assert not big.offer() and offered[-1] == head + b"x" * 20000
    loop.advance(1.1)
    assert b"503" in transport.written and not transport.paused  # its turn never came: answered, drained
    assert big.waits_with() == 0
    big.gone()


def test_a_refusal_waiting_in_line_gets_its_503_at_the_line_timeout_not_its_pause():
    from services.runtime.edge.connection_room import RefusedNewcomer

    loop = FakeLoop()
    waiting = RefusedNewcomer(loop, transport := HeldTransport(), 8, take_late=lambda data: False, pace_s=1.0)
    loop.advance(0.5)
    waiting.data_received(b"GET /v1/x HTTP/1.1\r\n\r\n")
    waiting.wait_in_line(4.0)
    loop.advance(3.0)  # 3.5 s after its accept: still waiting
    assert transport.written == b""
    loop.advance(0.75)
    assert b"too_many_connections" in transport.written
    waiting.gone()
    short = RefusedNewcomer(loop, transport := HeldTransport(), 8, take_late=lambda data: False, pace_s=1.0)
    short.data_received(b"GET /v1/x HTTP/1.1\r\n\r\n")
    short.wait_in_line(0.2)  # shorter than its pause: the pause stands
    loop.advance(0.75)
    assert transport.written == b""
    loop.advance(0.5)
    assert b"too_many_connections" in transport.written
    short.gone()


class InLine:
    """A refused connection, as admission's line sees it: its RefusedNewcomer and a place that
    the room may give it (``take_late``)."""

    def __init__(self, loop, admission, taken: list, data: bytes, limit: int = 8):
        from services.runtime.edge.connection_room import RefusedNewcomer
        self.name = data.split(b" ")[1].decode()
        # (``limit`` bounds the refusals waiting at once: PACED_PER_PLACE of it)
        self._refused = RefusedNewcomer(loop, HeldTransport(), limit, take_late=self.take, pace_s=1.0)
        self.admission, self.taken = admission, taken
        self._refused.data_received(data)
        admission.wait_for_place(self, self._refused.waits_with(), loop)

    def take(self, request: bytes) -> bool:
        from services.runtime.edge.connection_room import OVERFLOW, request_kind
        a = self.admission
        admitted = a.room.make_room(a.open_now, 0.0, lambda: request_kind(request))
        if admitted:
            a.open_now += 1
            self.taken.append((self.name, admitted is OVERFLOW))
        return bool(admitted)


def test_the_line_gives_places_oldest_first_and_a_whole_request_may_pass_a_begun_one_for_the_overflow():
    """A place that comes free goes to the oldest in line; when the oldest has only begun its
    request (no place within the limit for it), a whole request behind it may take one beyond
    the limit; probes go before all."""
    from services.runtime.edge.admission import Admission
    from services.runtime.edge.connection_limits import ConnectionLimits, ConnectionStats

    loop, taken = FakeLoop(), []
    a = Admission(ConnectionLimits(max_connections=8), ConnectionStats)
    a.open_now = 8 + 8  # the places and the overflow: every one busy
    upload = InLine(loop, a, taken, b"POST /upload HTTP/1.1\r\nContent-Length: 9\r\n\r\nab")
    first = InLine(loop, a, taken, b"GET /first HTTP/1.1\r\n\r\n")
    second = InLine(loop, a, taken, b"GET /second HTTP/1.1\r\n\r\n")
    assert a.line_ahead and taken == []
    a.open_now -= 1  # an overflow place came free
    a.offer_place()
    assert taken == [("/first", True)]  # the upload cannot take it; the first whole request behind it does
    a.open_now = 7  # the overflow's requests answered, and a place within the limit came free
    a.offer_place()
    assert taken == [("/first", True), ("/upload", False), ("/second", True)]
    assert not a.line_ahead
    a.open_now = 8 + 8 + 8  # the places, the overflow and the probes' reserve
    probe = InLine(loop, a, taken, b"GET /healthz HTTP/1.1\r\n\r\n")  # no door here: waits as a probe
    late = InLine(loop, a, taken, b"GET /late HTTP/1.1\r\n\r\n")
    a.open_now -= 1
    loop.advance(0.2)  # the line's tick: a place came free without a close
    assert taken[3:] == [("/healthz", True)] and a.line_ahead
    for conn in (upload, first, second, probe, late):
        conn._refused.gone()


def test_every_pool_of_descriptors_fits_under_the_descriptor_limit():
    """Open connections, the overflow beyond them, refusals waiting or lingering, connections
    told after making room, lingering closes and unread answers: at their bounds together
    they stay under RLIMIT_NOFILE."""
    from services.runtime.edge.connection_limits import limits_from_settings
    from services.runtime.edge.connection_room import PACED_PER_PLACE, PROBE_RESERVE, QUICK_OVERFLOW
    from services.runtime.settings import ServiceSettings

    for fds in (256, 1024, 4096, 65536):
        limit = limits_from_settings(ServiceSettings(max_connections=1_000_000), fds=fds).max_connections
        overflow = max(8, int(limit * QUICK_OVERFLOW)) + PROBE_RESERVE
        total = limit + overflow + 2 * PACED_PER_PLACE * limit + PACED_PER_PLACE * limit + limit + limit
        assert total + 64 <= fds or limit == 16, (fds, limit, total)


def test_past_the_bound_the_refusal_waiting_longest_is_answered_and_the_newcomer_waits():
    """A newcomer refused at once had no time to send its request (a probe among hundreds of
    reconnecting clients got an instant 503): past PACED_PER_PLACE x the limit, the oldest
    waiting refusal is answered early instead."""
    from services.runtime.edge import connection_room
    from services.runtime.edge.connection_room import PACED_PER_PLACE, RefusedNewcomer

    loop, before = FakeLoop(), connection_room._lingering[0]
    assert before == 0, before  # nothing left over by other tests
    first, second, third = HeldTransport(), HeldTransport(), HeldTransport()
    refused = [RefusedNewcomer(loop, t, 1, take_late=lambda data: False, pace_s=1.0) for t in (first, second)]
    assert PACED_PER_PLACE * 1 == 2 and first.written == b"" == second.written
    refused.append(RefusedNewcomer(loop, third, 1, take_late=lambda data: False, pace_s=1.0))
    assert b"too_many_connections" in first.written and first.eof  # answered early, lingering
    assert second.written == b"" and third.written == b""          # still waiting for their bytes
    loop.advance(1.1)
    assert b"too_many_connections" in second.written and b"too_many_connections" in third.written
    for r in refused:
        r.gone()
    assert connection_room._lingering[0] == before and not connection_room._waiting


class SocketHeldTransport(HeldTransport):
    """A HeldTransport over a real socket (what a peek at its unread bytes reads)."""

    def __init__(self, sock):
        super().__init__()
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


def test_a_refusal_answered_early_with_a_probe_still_unread_gets_the_door_answer():
    """Answered early to make room for a newer refusal, the oldest one's GET /healthz may be in
    its socket, not read yet: it gets the door's answer, not a 503 (a probe among hundreds of
    refusals got 503 that way)."""
    import socket

    from services.runtime.edge import connection_room
    from services.runtime.edge.connection_room import RefusedNewcomer

    loop, before = FakeLoop(), connection_room._lingering[0]
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # in its socket, not read
        door = lambda request: b"DOOR " + request.split(b" ")[1]  # noqa: E731
        oldest = SocketHeldTransport(ours)
        refused = [RefusedNewcomer(loop, oldest, 1, take_late=lambda data: False, pace_s=1.0, answer_probe=door)]
        refused += [RefusedNewcomer(loop, t, 1, take_late=lambda data: False, pace_s=1.0, answer_probe=door)
                    for t in (HeldTransport(), HeldTransport())]
        assert oldest.written == b"DOOR /healthz" and oldest.eof  # answered early, at the door
        for r in refused:
            r.gone()
        assert connection_room._lingering[0] == before
    finally:
        ours.close()
        theirs.close()


def test_the_door_answers_only_a_plain_get_of_healthz_and_never_raises():
    from types import SimpleNamespace

    from services.runtime.shell.health_answer import health_at_the_door

    beats = []
    shell = SimpleNamespace(instance="tok\r\nset-cookie: x=1", health=lambda: (200, {"status": "ok"}),
                            heartbeat=SimpleNamespace(beat=lambda: beats.append(1)))
    door = health_at_the_door(shell)
    answer = door(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}')
    assert beats == [1]  # answered on the loop: it counts as the loop's beat
    assert b"set-cookie" not in answer.split(b"\r\n\r\n")[0]  # a value with a line break is left out
    assert door(b"GET /healthz FOO/9\r\n\r\n") is None and door(b"HEAD /healthz HTTP/1.1\r\n\r\n") is None
    assert door(b"GET /healthz?x=1 HTTP/1.1\r\n\r\n") is None

    def broken():
        raise RuntimeError("the part cannot say")
    assert health_at_the_door(SimpleNamespace(instance="", health=broken, heartbeat=shell.heartbeat))(
        b"GET /healthz HTTP/1.1\r\n\r\n") is None  # refused as any other; the route answers it


def test_the_supervisors_slots_never_close_a_connection_whose_whole_request_waits_unread():
    """No silent connection left to close: of those with bytes, one whose whole request is in
    its socket (a probe about to be answered) is spared; a half-sent head makes room."""

    from supervisor.servers.connection_slots import Slots

    aborted: list = []
    with socket_pairs(4) as pairs:
        slots = Slots(2, fresh_s=0.0)  # order alone decides here
        probe, half, newcomer, last = (SlotWriter(ours, aborted) for ours, _ in pairs)
        pairs[0][1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        pairs[1][1].sendall(b"GET /healthz HTTP/1.1\r\nHo")
        assert slots.admit(probe) and slots.admit(half)
        assert slots.admit(newcomer) and aborted == [half]
        pairs[2][1].sendall(b"GET /readyz HTTP/1.1\r\n\r\n")
        assert not slots.admit(last) and aborted == [half]  # both waiting are whole: refused


def test_lingering_sockets_ready_together_are_read_one_by_one_within_the_rate():
    """Twenty sockets with a refused body's bytes waiting, all readable in the same turn of the
    loop: they are not all read in it (200 refused 30 MB uploads drained 200 MiB in one turn,
    20 ms of the kernel's work between two probes). What is read keeps within the burst and the
    rate, each socket's read is booked in turn (not all woken together every time the rate
    allows one), and every byte is still drained."""
    import asyncio
    import socket

    from services.runtime.edge.lingering_close import DrainRate, LingeringClose

    rate, burst, each, n = 4 << 20, 256 << 10, 100_000, 20

    async def scenario():
        loop = asyncio.get_running_loop()
        lingering = LingeringClose(limit=64, idle_s=30, total_s=60)
        lingering.drain_rate = DrainRate(rate, burst)
        pairs = [socket.socketpair() for _ in range(n)]
        try:
            for ours, theirs in pairs:
                ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                theirs.sendall(b"b" * each)
            t0 = loop.time()
            for ours, _theirs in pairs:
                assert lingering.adopt(loop, ours, body_unfinished=True)
                ours.close()
            await asyncio.sleep(0.02)
            early = lingering.drained_bytes
            assert early <= burst + each + rate * (loop.time() - t0), early
            while lingering.drained_bytes < n * each and loop.time() - t0 < 10:
                await asyncio.sleep(0.02)
            assert lingering.drained_bytes == n * each
            assert lingering.paused <= 2 * n  # about once a socket: booked, then read
        finally:
            for ours, theirs in pairs:
                ours.close()
                theirs.close()

    asyncio.run(scenario())


class QueueTransport:
    """A paused connection's transport: its buffer, and a socket whose kernel queue the test sets."""

    def __init__(self):
        self.buffered = 64 * 1024

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str):
        return type("Sock", (), {"fileno": lambda self: 7})() if name == "socket" else None


def test_what_a_client_took_is_dated_to_the_look_that_saw_it_not_to_the_question(monkeypatch):
    """A client that reads nothing: its kernel queue shrinks once just after the writes pause
    (its receive window filling), then never. That shrink is seen at the first look (a quarter
    second on), not at the first question 2 s later: asked then, the connection has taken
    nothing for 1.75 s (it made room only 2 s later, as if it had read something)."""
    from services.runtime.edge import send_deadline
    from services.runtime.edge.send_deadline import FIRST_LOOK_S, SendWatch

    kernel = {"queued": 500_000}
    monkeypatch.setattr(send_deadline, "unsent_bytes", lambda fd: kernel["queued"])
    loop, transport = FakeLoop(), QueueTransport()
    watch = SendWatch(loop, transport, 30.0, on_stuck=lambda: None)
    watch.start()
    loop.advance(0.1, step=0.05)
    kernel["queued"] = 430_000  # the client's window took some: once
    loop.advance(2.0 - 0.1, step=0.05)
    assert watch.last_taken() == pytest.approx(FIRST_LOOK_S, abs=0.05)
    kernel["queued"] = 400_000  # a slow reader's next read: dated to now
    loop.advance(0.5, step=0.05)
    assert watch.last_taken() == pytest.approx(2.25, abs=0.1)  # the tick at 2.25 s saw it


def test_a_connections_kernel_send_queue_is_capped_or_left_to_the_kernel():
    import socket

    from services.runtime.edge.send_deadline import cap_send_buffer

    class Held:
        def __init__(self, sock):
            self.sock = sock

        def get_extra_info(self, name):
            return self.sock if name == "socket" else None

    a, b = socket.socketpair()
    try:
        before = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        cap_send_buffer(Held(a), 0)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
        cap_send_buffer(Held(a), 64 * 1024)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 64 * 1024  # Linux doubles it
        a.close()
        cap_send_buffer(Held(a), 64 * 1024)  # a closed socket: nothing raised
    finally:
        a.close()
        b.close()


def test_the_heap_is_trimmed_once_a_burst_of_request_bodies_is_over():
    """Trimmed when the bodies being read, having reached the burst size, fall to a tenth of
    their peak; not for a small one; at most once every MIN_INTERVAL_S."""
    from services.runtime.edge.body_bytes import MIN_INTERVAL_S, BodyBytes

    clock, trims = FakeLoop(), []
    bodies = BodyBytes(lambda: trims.append(clock.now), burst_bytes=1000, clock=clock.time)
    for _ in range(9):
        bodies.read(100)
    for _ in range(9):
        bodies.let_go(100)
    assert trims == []  # 900 bytes at most: no burst
    for _ in range(20):
        bodies.read(100)
    for _ in range(17):
        bodies.let_go(100)
    assert trims == [] and bodies.held == 300  # still over a tenth of the 2000 held at the peak
    bodies.let_go(100)
    assert trims == [0.0] and bodies.trims == 1
    bodies.let_go(200)
    bodies.read(5000)
    bodies.let_go(5000)
    assert trims == [0.0]  # a second burst within MIN_INTERVAL_S
    clock.now += MIN_INTERVAL_S
    bodies.read(5000)
    bodies.let_go(5000)
    assert trims == [0.0, MIN_INTERVAL_S] and bodies.held == 0
    # with the loop's call_later, a burst over too soon is trimmed when the interval is up
    put_off = FakeLoop()
    put_off.now = clock.now = 100.0
    bodies = BodyBytes(lambda: trims.append(put_off.now), burst_bytes=1000, clock=put_off.time,
                       later=put_off.call_later)
    for _ in range(2):
        bodies.read(5000)
        bodies.let_go(5000)
    assert trims[2:] == [100.0]
    put_off.advance(MIN_INTERVAL_S + 0.5)
    assert trims[2:] == [100.0, 100.0 + MIN_INTERVAL_S] and len(put_off.timers) == 0


def test_a_whole_request_behind_many_begun_uploads_takes_a_place_beyond_the_limit():
    """helper-56: the line was looked at 32 entries deep: a GET behind 40 uploads that had
    only begun never saw the overflow place that came free, and waited for its 503."""
    from services.runtime.edge.admission import Admission
    from services.runtime.edge.connection_limits import ConnectionLimits, ConnectionStats

    loop, taken = FakeLoop(), []
    a = Admission(ConnectionLimits(max_connections=8), ConnectionStats)
    a.open_now = 8 + 8
    uploads = [InLine(loop, a, taken, f"POST /up{i} HTTP/1.1\r\nContent-Length: 9\r\n\r\nab".encode(), 64)
               for i in range(40)]
    get = InLine(loop, a, taken, b"GET /small HTTP/1.1\r\n\r\n", 64)
    a.open_now -= 1  # an overflow place came free
    a.offer_place()
    assert taken == [("/small", True)]
    assert a.line_ahead
    for conn in (*uploads, get):
        conn._refused.gone()


def test_a_refused_newcomer_whose_client_left_is_closed_not_taken():
    """Its reading paused, the client's close is not seen: taken, it would have made a live
    connection give way for nobody (helper-56). Its TCP state says the client left."""
    import socket

    from services.runtime.edge.connection_room import RefusedNewcomer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    ours, _ = listener.accept()
    try:
        loop, offered = FakeLoop(), []
        refused = RefusedNewcomer(loop, transport := SocketHeldTransport(ours), 8,
                                  take_late=lambda data: offered.append(data) or True, pace_s=1.0)
        refused.data_received(b"POST /a HTTP/1.1\r\nContent-Length: 99999\r\n\r\n" + b"x" * 20000)
        assert transport.paused  # what comes next waits in the socket, unread
        client.close()
        time.sleep(0.05)
        assert not refused.offer() and offered == [] and transport.closed
        assert refused.waits_with() == 0  # out of the line
        refused.gone()
    finally:
        client.close()
        ours.close()
        listener.close()

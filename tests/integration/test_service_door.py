"""The service port's door (services.runtime.edge.door) on a real listening socket and a real
event loop: the clients connect (and write, reset or close) while the loop is not running,
so that what waits in the accept queue is known when the door looks at it."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import httpx
import pytest

from common.accepting import accept_one
from services.runtime.edge.connection_limits import ConnectionStats
from services.runtime.edge.door import CLOSED_PER_TURN, SETUPS_PER_TURN, Door

PROBE = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


class Stats(ConnectionStats):
    pass


class Recorder(asyncio.Protocol):
    """What the door handed on: the first bytes each connection brought, in order."""
    made: list[Recorder] = []

    def __init__(self):
        self.data = b""
        self.turn = Door_turn[0]

    def connection_made(self, transport):
        Recorder.made.append(self)
        self.transport = transport

    def data_received(self, data):
        self.data += data


Door_turn = [0]


def probe_answer(request: bytes) -> bytes | None:
    return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok" \
        if request.startswith(b"GET /healthz ") else None


@pytest.fixture()
def door():
    loop = asyncio.new_event_loop()
    Recorder.made = []
    for name in [n for n in vars(Stats) if not n.startswith("_")]:
        setattr(Stats, name, 0)
    server = loop.run_until_complete(loop.create_server(Recorder, "127.0.0.1", 0, backlog=256))
    d = Door(loop, Stats, probe_answer, max_waiting=64)
    assert d.open([server])
    clients: list[socket.socket] = []
    try:
        yield d, server.sockets[0].getsockname()[1], clients
    finally:
        for c in clients:
            c.close()
        d.close()
        server.close()
        loop.run_until_complete(server.wait_closed())
        for r in Recorder.made:
            r.transport.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def connect(port: int, clients: list, data: bytes = b"", then: str = "") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    clients.append(s)
    if data:
        s.sendall(data)
    if then == "reset":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    elif then == "close":
        s.close()
    elif then == "shut":
        s.shutdown(socket.SHUT_WR)
    return s


def turns(d: Door, n: int) -> None:
    """n turns of the loop, exactly (run_forever with its stop already asked for runs one)."""
    for _ in range(n):
        Door_turn[0] += 1
        d.loop.call_soon(d.loop.stop)
        d.loop.run_forever()
    time.sleep(0.01)


def test_connections_their_clients_left_are_closed_at_the_door_and_the_rest_handed_on(door):
    d, port, clients = door
    connect(port, clients, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", then="reset")  # answer unreadable
    connect(port, clients, then="close")                                       # not a byte
    connect(port, clients, b"GET /half HTTP/1.1\r\nHo", then="reset")            # half, and reset
    half = connect(port, clients, b"GET /half HTTP/1.1\r\nHo", then="shut")      # may still read its 400
    kept = connect(port, clients, b"GET /kept HTTP/1.1\r\nHost: x\r\n\r\n")
    shut = connect(port, clients, b"GET /shut HTTP/1.1\r\nHost: x\r\n\r\n", then="shut")  # may still read
    slow = connect(port, clients)                                              # nothing yet: a client on its way
    time.sleep(0.1)  # the resets and FINs are in
    turns(d, 6)
    assert Stats.gone_at_accept == 4  # the whole request whose client closed its side: left before it was taken
    assert [r.data.split(b"\r\n")[0] for r in Recorder.made] == [b"GET /kept HTTP/1.1", b"", b"GET /half HTTP/1.1"]
    assert {kept, shut, slow, half} <= set(clients)


def test_a_whole_probe_is_answered_at_the_door_ahead_of_the_others(door):
    d, port, clients = door
    for _ in range(40):
        connect(port, clients, b"GET /work HTTP/1.1\r\nHost: x\r\n\r\n")
    probe = connect(port, clients, PROBE)
    half_probe = connect(port, clients, PROBE[:10])  # not whole yet: handed on as any other
    time.sleep(0.05)
    turns(d, 1)
    assert probe.recv(4096).endswith(b"\r\n\r\nok") and probe.recv(4096) == b""  # answered and closed
    assert Stats.probes_at_accept == 1 and len(Recorder.made) < 40  # before the others were set up
    turns(d, 8)
    assert len(Recorder.made) == 41 and half_probe in clients


def test_set_ups_are_spread_over_turns_and_those_whose_client_closed_its_side_go_last(door):
    d, port, clients = door
    for _ in range(5):
        connect(port, clients, b"GET /shut HTTP/1.1\r\nHo", then="shut")  # half a request: its 400 to come
    for _ in range(40):
        connect(port, clients, b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.05)
    turns(d, 12)
    assert len(Recorder.made) == 45
    per_turn: dict[int, int] = {}
    for r in Recorder.made:
        per_turn[r.turn] = per_turn.get(r.turn, 0) + 1
    assert max(per_turn.values()) <= SETUPS_PER_TURN and len(per_turn) >= 3, per_turn
    turns(d, 2)
    assert [r.data.split(b" HTTP")[0] for r in Recorder.made][-5:] == [b"GET /shut"] * 5
    last = [r.turn for r in Recorder.made][-5:]  # a few a turn: each is the loop's work for a 400 nobody may read
    assert max(last.count(t) for t in last) == CLOSED_PER_TURN == 4 and len(set(last)) == 2, last


def test_with_max_waiting_queued_newcomers_wait_in_the_kernel_not_refused(door):
    """The door refuses no one: with 64 waiting to be set up it stops accepting, and the rest
    wait for the room's own decision (its overflow, its probe reserve, its paced refusals)."""
    d, port, clients = door
    for _ in range(80):
        connect(port, clients, b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.05)
    turns(d, 1)
    assert d.queued + len(d._setups) == 64  # 16 of them on their way to a protocol already
    assert all(_answer_or_none(c) is None for c in clients) and Stats.refused == 0
    turns(d, 12)
    assert len(Recorder.made) == 80


def test_closed_the_door_accepts_no_more_and_lets_the_queued_go(door):
    d, port, clients = door
    for _ in range(40):
        connect(port, clients, b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.05)
    turns(d, 1)
    queued = d.queued
    assert 0 < queued < 40
    d.close()
    turns(d, 4)
    assert len(Recorder.made) == 40 - queued
    late = connect(port, clients, PROBE)
    turns(d, 2)
    assert _answer_or_none(late) is None  # nobody accepts it now


def _answer_or_none(s: socket.socket) -> bytes | None:
    s.settimeout(0.05)
    try:
        return s.recv(4096)
    except (TimeoutError, BlockingIOError):
        return None
    except OSError:
        return b""


def test_a_real_service_answers_at_its_door(tmp_path):
    """A service process stopped (SIGSTOP) while clients reset their connections and a probe
    sends its whole request: resumed, it closes the reset ones without a protocol and answers
    the probe as it accepts it; the metrics say so."""
    import os
    import re
    import signal

    from tests.service_harness import ServiceProcess

    with ServiceProcess("tests.children.scripted_app:create_app", {}, tmp_path) as svc:
        port = int(svc.url.rsplit(":", 1)[1])
        os.kill(svc.proc.pid, signal.SIGSTOP)
        clients: list[socket.socket] = []
        try:
            for _ in range(5):
                connect(port, clients, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", then="reset")
            probe = connect(port, clients, PROBE)
        finally:
            os.kill(svc.proc.pid, signal.SIGCONT)
        try:
            answer = b""
            while chunk := probe.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower(), answer
            metrics = httpx.get(svc.url + "/metrics", timeout=30).text
        finally:
            for c in clients:
                c.close()
        counts = {name: float(value) for name, value in re.findall(r"^(onecard_\w+_at_accept_total) (\S+)$",
                                                                  metrics, re.M)}
        assert counts == {"onecard_probes_answered_at_accept_total": 1.0,
                          "onecard_connections_gone_at_accept_total": 5.0}, counts


def test_a_queued_connection_its_client_left_meanwhile_is_not_set_up(door):
    d, port, clients = door
    for _ in range(40):
        connect(port, clients, b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.05)
    turns(d, 1)  # 16 on their way, 24 waiting
    assert d.queued == 24
    for c in clients[-10:]:  # the last ten leave: five reset, five close after their whole request
        if c in clients[-5:]:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
    time.sleep(0.1)
    turns(d, 8)
    assert len(Recorder.made) == 30 and Stats.gone_at_accept == 10


def _can_take(niceness: int) -> bool:
    """Whether a thread of this process may run at `niceness` (root with CAP_SYS_NICE, say)."""
    import os
    import threading
    took: list[bool] = []

    def try_it() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
            took.append(True)
        except OSError:
            took.append(False)
    t = threading.Thread(target=try_it)
    t.start()
    t.join()
    return took[0]


def test_a_real_service_runs_its_event_loop_ahead_of_other_processes_where_allowed(tmp_path):
    """The loop thread runs at LOOP_NICENESS where the OS allows it (here if a thread of this
    process may take it); elsewhere as it was."""
    import os

    from services.runtime.device.threads import LOOP_NICENESS
    from tests.service_harness import ServiceProcess

    with ServiceProcess("tests.children.scripted_app:create_app", {}, tmp_path) as svc:
        main = os.getpriority(os.PRIO_PROCESS, svc.proc.pid)  # the main thread: its id is the pid
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert main == (LOOP_NICENESS if _can_take(LOOP_NICENESS) and mine > LOOP_NICENESS else mine), main


def busy_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_probe_arriving_during_a_long_turn_is_answered_within_it(door):
    """A turn of 100 callbacks of 1 ms each (the loop's queue made a TurnLane): a probe that
    connects during the 10th is answered a few callbacks later, not after the 100th (asyncio
    polls its sockets once a turn)."""
    from services.runtime.edge import turn_lane
    d, port, clients = door
    assert turn_lane.install(d.loop, d.look)
    ran: list[int] = []
    answered_after: list[int] = []

    def answer(request: bytes) -> bytes | None:
        answered_after.append(len(ran))
        return probe_answer(request)
    d.probe_answer = answer

    def callback(i: int) -> None:
        if i == 10:
            connect(port, clients, PROBE)
        busy_for(0.001)
        ran.append(i)
    for i in range(100):
        d.loop.call_soon(callback, i)
    turns(d, 1)
    assert ran == list(range(100))  # one turn, in order
    assert len(answered_after) == 1 and answered_after[0] <= 16, answered_after
    assert clients[0].recv(100).startswith(b"HTTP/1.1 200")


def test_a_listener_whose_accepting_is_paused_is_not_looked_at_until_it_resumes(door, monkeypatch):
    """Out of descriptors the door pauses a listener for RETRY_S: the looks between callbacks
    leave it alone until its resume has run, even in a turn longer than RETRY_S (each would
    try, fail, and pause it again with a second resume pending)."""
    from services.runtime.edge import door as door_module
    from services.runtime.edge import turn_lane
    d, port, clients = door
    assert turn_lane.install(d.loop, d.look)
    tries = [0]

    def out_of_descriptors(listener):
        tries[0] += 1
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(door_module, "accept_one", out_of_descriptors)
    connect(port, clients, PROBE)
    time.sleep(0.05)
    turns(d, 1)
    assert tries[0] == 1
    for _ in range(150):  # a turn of 150 ms, past RETRY_S: its looks leave the listener alone
        d.loop.call_soon(busy_for, 0.001)
    turns(d, 1)
    assert tries[0] == 1
    monkeypatch.setattr(door_module, "accept_one", accept_one)
    time.sleep(door_module.RETRY_S)
    turns(d, 2)  # the resume, then the accept
    assert clients[0].recv(100).startswith(b"HTTP/1.1 200")


def test_looks_between_callbacks_accept_but_set_ups_stay_a_few_a_turn(door):
    """Connections accepted between the callbacks of a long turn are set up from the queue,
    SETUPS_PER_TURN a turn, as those accepted at a turn's start (a look that set them up
    itself started 16 at each look: 240 in one turn here)."""
    import collections

    from services.runtime.edge import turn_lane
    d, port, clients = door
    assert turn_lane.install(d.loop, d.look)

    def callback(i: int) -> None:
        if i % 2 == 0:
            for _ in range(5):
                connect(port, clients, b"GET /w HTTP/1.1\r\nHost: x\r\n\r\n")
        busy_for(0.001)
    for i in range(100):
        d.loop.call_soon(callback, i)
    turns(d, 24)
    per_turn = collections.Counter(r.turn for r in Recorder.made)
    assert len(Recorder.made) == 250
    assert max(per_turn.values()) <= SETUPS_PER_TURN, per_turn


def test_a_real_service_answers_a_probe_in_the_middle_of_a_long_turn(tmp_path):
    """The service process's loop looks at its door between callbacks: a probe sent in the
    middle of a 200 ms turn (200 callbacks of 1 ms, scheduled by the test app) is answered
    before the turn ends."""
    from tests.service_harness import ServiceProcess

    with ServiceProcess("tests.children.scripted_app:create_app", {}, tmp_path) as svc:
        port = int(svc.url.rsplit(":", 1)[1])
        clients: list[socket.socket] = []
        try:
            assert httpx.get(svc.url + "/long_turn?n=200&ms=1", timeout=30).status_code == 200
            time.sleep(0.15)  # the turn runs from about 50 ms to 250 ms from the answer
            sent = time.monotonic()
            probe = connect(port, clients, PROBE)
            answer = probe.recv(4096)
            answered = time.monotonic()
            assert answer.startswith(b"HTTP/1.1 200"), answer
            ran = httpx.get(svc.url + "/long_turn/ran", timeout=30).json()["ran"]
        finally:
            for c in clients:
                c.close()
    assert len(ran) == 200
    assert ran[0] < sent < ran[-1], "the probe was meant to arrive during the turn"
    assert answered < ran[-1], (answered - sent, ran[-1] - sent)

"""The probe port looks at each connection as it accepts it (supervisor/servers/probe_port.py):
one its client closed without a byte (or with half a request) is closed there, one whose whole
request came with it is answered there, and neither costs a stream, a task or a slot. A stream
a connection cost the loop about 250 us: 24 threads that connected and closed in a loop kept
the listen queue full and a probe's connection waited a second in it (7 of 72 probes failed)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from common import http1
from supervisor.config.settings import SupervisorSettings
from supervisor.servers.probe_port import ProbePortServer
from tests.harness import free_port


@pytest.fixture()
def probe_port():
    """A probe port on a loop of its own thread; `hold(s)` keeps that loop busy for s seconds,
    so that connections made meanwhile wait in the listen queue as they would on a busy one."""
    loop = asyncio.new_event_loop()
    server = ProbePortServer(SupervisorSettings(health_port=free_port(), health_host="127.0.0.1"),
                             {"/healthz": lambda: http1.json_answer(200, {"status": "ok"})})
    streams = []
    original = server._handle

    async def counted(reader, writer):
        streams.append(writer)
        await original(reader, writer)

    server._handle = counted
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)

    def hold(seconds: float) -> None:
        loop.call_soon_threadsafe(time.sleep, seconds)

    try:
        yield server, streams, hold
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def test_clients_that_leave_at_once_cost_no_stream_and_probes_are_answered_at_accept(probe_port):
    server, streams, hold = probe_port
    hold(0.5)
    time.sleep(0.05)
    probes = []
    for i in range(60):
        s = _connect(server.port)
        kind = i % 4
        if kind == 0:
            s.close()                                        # connect, close
        elif kind == 1:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()                                        # connect, reset
        elif kind == 2:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHo")        # half a request, then close
            s.close()
        else:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")   # a probe: its request with its connect
            probes.append(s)
    for s in probes:
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        s.close()
        assert got.startswith(b"HTTP/1.1 200") and b'"ok"' in got, got
    time.sleep(0.2)
    assert streams == []
    assert server.answered_at_accept == 15 and server.gone_at_accept == 45


def test_a_silent_or_slow_client_still_gets_a_stream_and_its_answer(probe_port):
    server, streams, _ = probe_port
    s = _connect(server.port)
    time.sleep(0.2)
    s.sendall(b"GET /healthz HTTP/1.1\r\n")
    time.sleep(0.1)
    s.sendall(b"Host: x\r\n\r\n")
    got = s.recv(4096)
    s.close()
    assert got.startswith(b"HTTP/1.1 200")
    assert len(streams) == 1 and server.answered_at_accept == 0
    with _connect(server.port) as s:  # a request answered at accept goes through the same routes
        s.sendall(b"HEAD /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        got = s.recv(4096)
    assert got.startswith(b"HTTP/1.1 404") and got.endswith(b"\r\n\r\n"), got


_OUT_OF_DESCRIPTORS_CHILD = """
import asyncio, os, resource, socket, sys
from common import http1
from supervisor.config.settings import SupervisorSettings
from supervisor.servers import probe_port as pp
calls = [0]
accept = pp.ProbePortServer._accept
def counted(self, listener):
    calls[0] += 1
    return accept(self, listener)
pp.ProbePortServer._accept = counted
async def main():
    s = pp.ProbePortServer(SupervisorSettings(health_port=int(sys.argv[1]), health_host="127.0.0.1"),
                           {"/healthz": lambda: http1.json_answer(200, {"status": "ok"})})
    await s.start()
    c = socket.socket()
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    c.connect(("127.0.0.1", s.port))
    c.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    await asyncio.sleep(0.5)
    print("calls", calls[0])
    for fd in hog:
        os.close(fd)
    c.setblocking(False)
    answer = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(c, 4096), 5)
    print("answer", answer.split(b" ")[1].decode())
    c.close()
    await s.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
asyncio.run(main())
"""


def test_out_of_descriptors_pauses_accepting_instead_of_spinning_and_it_resumes():
    """accept() failing with EMFILE leaves the listener readable: asked again at every turn,
    the loop spun on it (24 745 calls in 0.3 s, found by helper-34). Accepting pauses a
    moment instead, and the waiting probe is answered once descriptors are free again."""
    import subprocess
    import sys

    from tests.harness import ROOT
    out = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS_CHILD, str(free_port())], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(line.split() for line in out.stdout.split("\n") if line)
    assert int(got["calls"]) <= 20, got
    assert got["answer"] == "200", got


def test_a_whole_request_sent_with_a_fin_is_answered_whatever_its_route(probe_port):
    """A client that sends its whole request and shuts its side (`nc -N`) reads its answer:
    a probe's at accept, any other route's through a stream."""
    server, streams, hold = probe_port
    hold(0.3)
    time.sleep(0.05)
    clients = []
    for path in (b"/healthz", b"/nope"):
        s = _connect(server.port)
        s.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        clients.append(s)
    answers = []
    for s in clients:
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        s.close()
        answers.append(got.split(b" ", 2)[1])
    assert answers == [b"200", b"404"], answers
    assert server.answered_at_accept == 1 and len(streams) == 1

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

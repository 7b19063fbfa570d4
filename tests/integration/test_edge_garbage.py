"""A connection is freed when it ends, not left to the cyclic garbage collector.

Hundreds of connections a second (refused, made to give way, answered) each left a ring of
objects (the protocol and its watchers, asyncio's transport, a lingering socket's
callbacks) that only a full collection frees: 40 000 objects a second under a flood of
reconnects, and a 50-150 ms pause of the event loop, the probes' included, every second or
two. The service runs here in this process (uvicorn on a thread, the guarded protocol and
the edge test app), so that the collector's findings can be read."""

from __future__ import annotations

import collections
import gc
import socket
import threading
import time

import pytest
import uvicorn

from services.runtime.edge.connection_limits import ConnectionLimits
from services.runtime.edge.connection_room import STALLED_BODY_S
from services.runtime.edge.protocol import guarded_protocol
from tests.children.edge_app import create_app

OURS = ("GuardedHttpProtocol", "_SelectorSocketTransport", "RequestResponseCycle", "RefusedNewcomer",
        "SendWatch", "BodyRate", "TurnedFlowControl", "LingeringClose")


@pytest.fixture()
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app({}), host="127.0.0.1", port=port, log_level="error", lifespan="on",
                            http=guarded_protocol(ConnectionLimits(max_connections=8, header_timeout_s=3.0)))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.started
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


def _ask(port: int, data: bytes, then_wait: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        s.sendall(data)
        time.sleep(then_wait)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError:
            pass
        return got


def test_ended_connections_leave_nothing_to_the_cyclic_collector(server):
    port = server
    upload_head = (b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                   b"Content-Length: 60000\r\nExpect: 100-continue\r\n\r\n")
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    holders: list[socket.socket] = []
    try:
        for _ in range(3):
            assert _ask(port, b"GET /wait?s=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(
                b"HTTP/1.1 200")
        # a body announced and never sent: answered from its head when the client leaves
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(upload_head)
                s.settimeout(5)
                assert s.recv(64).startswith(b"HTTP/1.1 100")
        time.sleep(0.3)  # their closes seen
        for _ in range(8):  # the port full of bodies owed by their clients
            s = socket.create_connection(("127.0.0.1", port))
            s.settimeout(5)
            s.sendall(upload_head)
            assert s.recv(64).startswith(b"HTTP/1.1 100")
            holders.append(s)
        t0 = time.monotonic()
        refused = _ask(port, upload_head)  # no body has stalled yet: refused, after a pause
        assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused, refused
        time.sleep(max(0.0, STALLED_BODY_S + 0.2 - (time.monotonic() - t0)))
        probe = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        assert _ask(port, probe).startswith(b"HTTP/1.1 200")  # it takes the longest stalled one's place
        assert b"body_stalled" in holders[0].recv(4096)
        for s in holders:  # the rest leave with their bodies unsent
            s.close()
        time.sleep(1.0)
        gc.collect()
        left = collections.Counter(type(o).__qualname__.rsplit(".", 1)[-1] for o in gc.garbage)
        closures = sum(1 for o in gc.garbage if type(o).__name__ == "function" and "adopt" in o.__qualname__)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        for s in holders:
            s.close()
    assert not {k: n for k, n in left.items() if k in OURS} and closures == 0, left.most_common(20)

"""The service's own probe listener (services.runtime.edge.probe_listener) cannot be starved: idle
holders are closed at a short deadline and give up their slot to a newcomer, so a probe
is answered however many of them come and go; malformed probe requests get their 4xx
in the JSON envelope. On real sockets, unix and TCP, and on a real service's socket."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

import pytest

from services.runtime.edge.probe_listener import MAX_REQUEST, ProbeServer, json_route
from tests.harness import free_port
from tests.service_harness import ServiceProcess, probe

SLOTS = 16


@pytest.fixture(params=["unix", "tcp"])
def listener(request):
    sock_dir = tempfile.mkdtemp(prefix="oc-probe-")
    path = os.path.join(sock_dir, "p.sock")
    port = free_port()
    server = ProbeServer({"/healthz": json_route(lambda: (200, {"status": "ok"}))},
                         unix_path=path if request.param == "unix" else None,
                         tcp=("127.0.0.1", port) if request.param == "tcp" else None,
                         max_clients=SLOTS, idle_timeout_s=1.0)
    server.start()

    def connect() -> socket.socket:
        if request.param == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
        else:
            s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(5)
        return s
    try:
        yield server, connect
    finally:
        server.stop()
        os.rmdir(sock_dir) if not os.listdir(sock_dir) else None


def ask(connect, raw: bytes) -> tuple[int, bytes]:
    with connect() as s:
        s.sendall(raw)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def healthz(connect) -> int:
    return ask(connect, b"GET /healthz HTTP/1.1\r\nHost: probe\r\n\r\n")[0]


def test_idle_holders_on_every_slot_do_not_starve_a_probe(listener):
    server, connect = listener
    holders = [connect() for _ in range(SLOTS * 3)]  # three times the slots, none sends a byte
    try:
        for _ in range(10):
            assert healthz(connect) == 200
        assert server.evicted >= SLOTS * 2
    finally:
        for s in holders:
            s.close()


def test_holders_reopened_as_fast_as_they_are_closed_do_not_starve_a_probe(listener):
    server, connect = listener
    holders = [connect() for _ in range(SLOTS)]
    try:
        for _round in range(6):
            for i, s in enumerate(holders):  # every holder replaced by a new one, every round
                s.close()
                holders[i] = connect()
                holders[i].sendall(b"GET /heal")  # a partial request, never finished
            assert healthz(connect) == 200
    finally:
        for s in holders:
            s.close()


def test_an_idle_holder_is_closed_at_the_idle_deadline(listener):
    _, connect = listener
    with connect() as s:
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the listener, no answer to a client that said nothing
        assert time.monotonic() - t0 < 4.5  # the socket's own timeout would raise at 5 s


def test_a_partial_request_at_the_deadline_gets_408(listener):
    _, connect = listener
    status, body = ask(connect, b"GET /healthz HTTP/1.1\r\n")
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("raw,status,code", [
    (b"GET /healthz HTTP/1.1\r\nX-Big: " + b"v" * (MAX_REQUEST + 100) + b"\r\n\r\n", 431, "headers_too_large"),
    (b"POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405, "method_not_allowed"),
    (b"GET /nope HTTP/1.1\r\n\r\n", 404, "not_found"),
])
def test_malformed_probe_requests_get_their_4xx_in_json(listener, raw, status, code):
    _, connect = listener
    got, body = ask(connect, raw)
    assert got == status and json.loads(body)["error"]["code"] == code


def test_a_real_service_probe_socket_answers_through_a_crowd_of_holders(tmp_path):
    with ServiceProcess("tests.children.scripted_app:create_app", {}, tmp_path) as svc:
        holders = []
        try:
            for _ in range(400):  # over the listener's 256 slots
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(svc.probe_socket)
                holders.append(s)
            for _ in range(5):
                status, doc = probe(svc.probe_socket, "/healthz", timeout=2.0)
                assert status == 200 and doc["instance"] == svc.instance
        finally:
            for s in holders:
                s.close()

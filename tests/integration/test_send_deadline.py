"""The send deadline on a real service: clients that do not read their answers keep
nothing pinned for longer than ``send_timeout_s`` without progress, neither in the
process (RSS) nor in the kernel (the sockets' send queues); a slow client that keeps
reading gets its whole answer."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import psutil
import pytest

from tests.service_harness import ServiceProcess

APP = "tests.children.edge_app:create_app"
SEND_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    settings = {"send_timeout_s": SEND_TIMEOUT_S, "keepalive_timeout_s": 0.5}
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("send")) as s:
        yield s


def metric(svc, name: str) -> float:
    for line in httpx.get(svc.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics: {httpx.get(svc.url + '/metrics').text[:300]}")


def send_queue_bytes(port: int) -> int:
    """What the kernel holds unsent or unacknowledged on the server side of ``port`` (Linux)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                total += int(fields[4].split(":")[0], 16)
    return total


def server_sockets(svc) -> int:
    return sum(1 for c in psutil.Process(svc.proc.pid).net_connections("tcp")
               if c.laddr and c.laddr.port == svc.port and c.status != psutil.CONN_LISTEN)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout} s")


def ask_and_never_read(svc, path: str, rcvbuf: int = 4096) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", svc.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # the client's window stays small
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def drain(s: socket.socket) -> tuple[int, str]:
    """Bytes left to read and how the connection ended: 'reset' or 'eof'."""
    s.settimeout(5)
    got = 0
    try:
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                return got, "eof"
            got += len(chunk)
    except ConnectionResetError:
        return got, "reset"


def test_clients_that_never_read_are_reset_and_their_answers_freed(svc):
    """Twenty clients asking for 8 MiB each and reading nothing: the answers were pinned in
    the process and the kernel; after the send deadline both are back near the start."""
    proc = psutil.Process(svc.proc.pid)
    httpx.get(svc.url + "/big?mb=8")  # the allocator's first big block, before the baseline
    rss_before = proc.memory_info().rss
    timeouts_before = metric(svc, "onecard_send_timeouts_total")
    clients = [ask_and_never_read(svc, "/big?mb=8") for _ in range(20)]
    try:
        # pinned in the process (the transport buffers) and in the kernel (the send queues);
        # how the 160 MiB split between them depends on the host's tcp_wmem
        wait_for(lambda: proc.memory_info().rss - rss_before + send_queue_bytes(svc.port) > 20 * 4 * 2**20,
                 10, "answers pinned")
        wait_for(lambda: server_sockets(svc) == 0, SEND_TIMEOUT_S * 4 + 10, "every stuck connection reset")
        assert send_queue_bytes(svc.port) == 0
        wait_for(lambda: proc.memory_info().rss - rss_before < 40 * 2**20, 10, "RSS back near its start")
        endings = [drain(s) for s in clients]
    finally:
        for s in clients:
            s.close()
    assert all(how == "reset" for _, how in endings), endings
    assert metric(svc, "onecard_send_timeouts_total") - timeouts_before >= 20
    assert httpx.get(svc.url + "/big?mb=1").status_code == 200


def test_a_client_reading_a_byte_at_a_time_is_cut(svc):
    """Its reads never free enough of the kernel's queue for the next write: no progress.
    (Its own kernel still hands it the bytes it had buffered before the reset.)"""
    timeouts_before = metric(svc, "onecard_send_timeouts_total")
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /big?mb=8 HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(1)

        def trickle() -> None:
            while not stop.is_set():
                try:
                    if not s.recv(1):
                        return
                except OSError:
                    return
                time.sleep(0.05)
        reader = threading.Thread(target=trickle)
        reader.start()
        try:
            wait_for(lambda: send_queue_bytes(svc.port) > 0, 10, "the answer on its way")
            wait_for(lambda: server_sockets(svc) == 0, SEND_TIMEOUT_S * 4 + 10, "the trickling reader cut")
        finally:
            stop.set()
            reader.join(5)
    assert metric(svc, "onecard_send_timeouts_total") - timeouts_before == 1


def test_a_slow_but_steady_reader_gets_its_whole_answer(svc):
    """About 3 MiB/s: every write makes progress well within the deadline."""
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.sendall(b"GET /big?mb=8 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        s.settimeout(10)
        data = bytearray()
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            time.sleep(0.02)
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == 8 * 2**20


def test_an_answer_left_unread_in_the_kernel_is_reset_after_the_connection_closes(svc):
    """300 KiB fits in the kernel's queue (send_buffer_bytes, 256 KiB, doubled by Linux): the
    app is done, the keep-alive expires, and the closed socket would otherwise keep the bytes
    and probe the client for minutes."""
    resets_before = metric(svc, "onecard_unread_answers_reset_total")
    s = ask_and_never_read(svc, "/big?mb=0.3")
    try:
        wait_for(lambda: send_queue_bytes(svc.port) > 64 * 1024, 10, "the answer in the kernel's queue")
        wait_for(lambda: send_queue_bytes(svc.port) == 0, SEND_TIMEOUT_S * 4 + 10, "the queue dropped")
        assert drain(s)[1] == "reset"
    finally:
        s.close()
    assert metric(svc, "onecard_unread_answers_reset_total") - resets_before >= 1


def test_a_late_reader_of_a_closed_connection_still_gets_its_answer(svc):
    """A client that reads after the keep-alive closed, within the deadline, loses nothing."""
    s = ask_and_never_read(svc, "/big?mb=4", rcvbuf=256 * 1024)  # a window over loopback's MSS: reads are fast
    try:
        wait_for(lambda: send_queue_bytes(svc.port) > 64 * 1024, 10, "the answer in the kernel's queue")
        time.sleep(1.0)  # the keep-alive (0.5 s) has closed the connection on the service's side
        got, ended = drain(s)
    finally:
        s.close()
    assert ended == "eof" and got > 4 * 2**20, (ended, got)

"""The line at max_connections (services.runtime.edge.admission), with uvicorn and the guarded
protocol on a thread of this process: clients that reconnect the moment they are reset do not
pass those waiting, an answer begun before its body is in makes room when its client reads
none of it, and what the kernel holds of an answer nobody reads is capped."""

from __future__ import annotations

import socket
import threading
import time

from common.socket_queues import TCP_CLOSE, TCP_CLOSE_WAIT, tcp_state
from services.runtime.edge.connection_limits import ConnectionLimits
from services.runtime.edge.connection_room import STALLED_ANSWER_S
from tests.integration.test_edge_in_process import _ask, _reset_within, serving

ASK_BIG = b"GET /stream?mb=16 HTTP/1.1\r\nHost: x\r\n\r\n"


def _unread_connection(port: int, request: bytes = ASK_BIG) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def test_clients_that_reconnect_at_once_wait_behind_those_already_waiting():
    """B27's short version: 36 connections reading none of a 16 MiB answer, each opened again
    the moment the server resets it, against 16 places (24 with the overflow). A newcomer that
    came while others waited went behind them (a reconnect could take a place the moment it
    arrived, and those waiting got 503 too_many_connections); every request of a client that
    reads its answers is answered 200."""
    holders: list[socket.socket] = []
    stop = threading.Event()
    reopened = [0]

    with serving(ConnectionLimits(max_connections=16, send_timeout_s=60), pace_s=(0.5, 1.0)) as port:
        def keep_holding() -> None:
            while not stop.is_set():
                for i, s in enumerate(holders):
                    if tcp_state(s) in (TCP_CLOSE, TCP_CLOSE_WAIT):  # its state: nothing of it is read
                        s.close()
                        holders[i] = _unread_connection(port)
                        reopened[0] += 1
                time.sleep(0.05)

        holding = threading.Thread(target=keep_holding, daemon=True)
        try:
            holders.extend(_unread_connection(port) for _ in range(36))
            holding.start()
            time.sleep(STALLED_ANSWER_S + 0.5)  # every place held by an answer nobody reads
            answers = []
            for n in range(6):
                t0 = time.monotonic()
                answer = _ask(port, f"GET /wait?s=0&tag=r{n} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                answers.append((answer[:12], round(time.monotonic() - t0, 2)))
            assert all(a.startswith(b"HTTP/1.1 200") for a, _ in answers), answers
            assert reopened[0] >= 6, reopened  # the holders were reset, and came back at once
        finally:
            stop.set()
            if holding.is_alive():
                holding.join(5)
            for s in holders:
                s.close()


def test_an_answer_begun_before_its_request_body_is_in_makes_room_when_nobody_reads_it():
    """helper-54: 600 clients sent GET with a 50 MB body at 2 kB/s and read none of the answer
    that began meanwhile: a connection with its body arriving never made room, and every place
    was theirs until the send deadline. Now its unread answer makes room, with a reset."""
    held: list[socket.socket] = []
    stop = threading.Event()
    head = b"GET /stream?mb=16 HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n" \
           b"Content-Length: 50000000\r\n\r\n"

    def trickle() -> None:  # a little of each body, often: none of them stalls
        while not stop.is_set():
            for s in held:
                try:
                    s.send(b"x" * 64)
                except OSError:
                    pass
            time.sleep(0.2)

    limits = ConnectionLimits(max_connections=4, send_timeout_s=60, min_body_rate_bytes_s=0, body_timeout_s=120)
    with serving(limits, pace_s=(0.5, 1.0)) as port:
        sending = threading.Thread(target=trickle, daemon=True)
        try:
            held.extend(_unread_connection(port, head + b"x" * 1024) for _ in range(4))  # no whole request: no overflow
            sending.start()
            time.sleep(STALLED_ANSWER_S + 0.5)
            t0 = time.monotonic()
            answer = _ask(port, b"GET /wait?s=0&tag=late HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200") and b'"tag":"late"' in answer, answer[:300]
            assert time.monotonic() - t0 < 3.0
            stop.set()
            sending.join(5)
            assert _reset_within(held, 5.0)  # an unread answer made room
        finally:
            stop.set()
            for s in held:
                s.close()


def _server_send_queue(port: int) -> list[int]:
    """The kernel send queues (bytes) of the server's side of its established connections, from
    /proc/net/tcp (its tx_queue column)."""
    queues = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, state, queue = fields[1], fields[3], fields[4]
            if state == "01" and int(local.split(":")[1], 16) == port:
                queues.append(int(queue.split(":")[0], 16))
    return queues


def test_what_the_kernel_holds_of_an_answer_nobody_reads_is_capped():
    """Autotuned, the kernel took 4 MiB of an answer its client did not read before the
    service's writes paused (and the service produced that much for it): capped, it takes
    twice send_buffer_bytes at most (Linux doubles the setting for its bookkeeping)."""
    held: list[socket.socket] = []
    with serving(ConnectionLimits(max_connections=8, send_buffer_bytes=64 * 1024, send_timeout_s=60)) as port:
        try:
            held.extend(_unread_connection(port) for _ in range(3))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and len([q for q in _server_send_queue(port) if q]) < 3:
                time.sleep(0.1)
            time.sleep(0.5)  # the queues full
            queues = [q for q in _server_send_queue(port) if q]
            assert len(queues) == 3 and max(queues) <= 2 * 64 * 1024 + 32 * 1024, queues
        finally:
            for s in held:
                s.close()


def test_a_burst_of_uploads_read_in_small_pieces_is_counted_and_the_heap_trimmed_once_it_is_over():
    """helper-55: 600 uploads of 1 MB at 80 kB/s left detect 309 MiB above its start, its heap
    fragmented by the 20 kB reads, and no model call came to trim it. The edge counts the
    bodies it reads: the burst over (here 24 bodies of 256 KiB in 16 KiB pieces, over a
    2 MiB burst size), the heap is trimmed, once; every body is let go once read whole, its
    connection still open."""
    from services.runtime.edge.body_bytes import BodyBytes

    trims: list[float] = []
    bodies = BodyBytes(lambda: trims.append(time.monotonic()), burst_bytes=2 * 2**20)
    uploads: list[socket.socket] = []
    size = 256 * 1024
    with serving(ConnectionLimits(max_connections=64), bodies=bodies) as port:
        try:
            for _ in range(24):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(f"POST /late_read?s=0 HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
                uploads.append(s)
            for _ in range(size // (16 * 1024)):  # every body half-read at once: a burst
                for s in uploads:
                    s.sendall(b"\x00" * 16 * 1024)
                time.sleep(0.005)
            for s in uploads:
                s.settimeout(10)
                assert s.recv(12).startswith(b"HTTP/1.1 200"), "no answer"  # read whole, and answered
            deadline = time.monotonic() + 2  # well before the keep-alive timeout (5 s) ends them
            while time.monotonic() < deadline and bodies.held:
                time.sleep(0.05)
            assert bodies.held == 0 and bodies.peak < 2 * 2**20 and len(trims) == 1, (bodies.held, trims)
        finally:
            for s in uploads:
                s.close()

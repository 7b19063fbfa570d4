"""Uploads that trickle, in a real service process: they hold no queue slot while their body
arrives (the slot is taken once it is all here), they hold in the memory ledger what they
have sent rather than what they announced, and a body slower than min_body_rate_bytes_s on
average is cut with 408 once body_rate_grace_s has passed, long before body_timeout_s.
A body that keeps a steady pace is served."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests import images as I
from tests.service_harness import ServiceProcess

APP = "tests.children.scripted_app:create_app"
PNG = I.small_png()
DECLARED = 600_000


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    settings = {"body_timeout_s": 30.0, "body_rate_grace_s": 1.0, "min_body_rate_bytes_s": 64 * 1024,
                "max_queue": 2, "max_batch_size": 1, "cpu_workers": 2, "max_connections": 64}
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("pace")) as s:
        yield s


def upload_head(tag: str, length: int = DECLARED) -> bytes:
    return (f"POST /api/v1/echo?id={tag} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


def metric(svc, name: str) -> float:
    for line in httpx.get(svc.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def read_all(s: socket.socket, limit_s: float) -> bytes:
    s.settimeout(limit_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_uploads_still_arriving_hold_no_queue_slot_and_only_what_they_sent(svc):
    """Six uploads announce 600 kB each and send 4 kB, against max_queue 2: before, each took
    a queue slot (and its announced size in the ledger) from its head on, and everyone else
    got 503 for as long as they trickled."""
    trickles = []
    try:
        for i in range(6):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(upload_head(f"trickle{i}") + b"\0" * 4096)
            trickles.append(s)
        time.sleep(0.3)
        held = metric(svc, "onecard_memory_held_bytes")
        assert held < 6 * 128 * 1024, held  # a little headroom over what arrived, not 6 x 600 kB
        for i in range(3):
            r = httpx.post(svc.url + f"/api/v1/echo?id=legit{i}", content=PNG,
                           headers={"content-type": "image/png"}, timeout=10)
            assert r.status_code == 200, r.text
    finally:
        for s in trickles:
            s.close()


def test_a_burst_of_whole_requests_over_max_queue_is_still_refused_undecoded(svc):
    """The slot is taken after the body, but before anything is decoded: a burst of slow
    requests beyond max_queue is refused (503) and none of it reaches the model."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: httpx.post(svc.url + f"/api/v1/echo?id=burst{i}&sleep=1.0", content=PNG,
                                                    headers={"content-type": "image/png"}, timeout=30).status_code,
                              range(8)))
    assert codes.count(503) >= 3 and codes.count(200) >= 1, codes
    seen = httpx.get(svc.url + "/seen").json()["seen"]
    assert len([i for i in seen if i.startswith("burst")]) == codes.count(200)


def test_a_body_slower_than_the_minimum_rate_is_cut_after_the_grace(svc):
    before = metric(svc, "onecard_bodies_too_slow_total")
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(upload_head("slow"))
        s.settimeout(0.25)
        t0, got = time.monotonic(), b""
        while time.monotonic() - t0 < 15:  # 4 kB/s: far under 64 kB/s, and body_timeout_s is 30 s
            try:
                s.sendall(b"\0" * 1024)
            except OSError:
                break
            try:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            except TimeoutError:
                pass
        else:
            raise AssertionError("a body at 4 kB/s still held its connection after 15 s")
        got += read_all(s, 5)
    assert got.startswith(b"HTTP/1.1 408") and b"body_too_slow" in got, got[:300]
    assert metric(svc, "onecard_bodies_too_slow_total") == before + 1
    assert httpx.post(svc.url + "/api/v1/echo?id=after-slow", content=PNG,
                      headers={"content-type": "image/png"}).status_code == 200


def test_a_client_still_sending_after_its_cut_reads_the_408_not_a_reset(svc):
    """The cut connection lingers briefly: a client that sends a few more pieces before it
    looks for an answer (as any uploader does) still finds the 408 in its queue. Closed at
    once, the server's kernel answered those pieces with a reset, which destroyed the 408."""
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(upload_head("after-cut"))
        t0 = time.monotonic()
        while True:  # 4 kB/s, looking (without reading) for the answer
            assert time.monotonic() - t0 < 15, "a body at 4 kB/s still held its connection after 15 s"
            s.sendall(b"\0" * 1024)
            time.sleep(0.25)
            s.setblocking(False)
            try:
                if s.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
        for _ in range(3):  # more body into the cut connection before the client reads
            time.sleep(0.2)
            s.sendall(b"\0" * 1024)
        got = read_all(s, 5)
    assert got.startswith(b"HTTP/1.1 408") and b"body_too_slow" in got, got[:300]


def test_a_body_at_a_steady_pace_past_the_grace_is_served(svc):
    picture = I.noisy_png(450, 450, 1.0)  # about 600 kB: 3 s at 200 kB/s
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(upload_head("steady", len(picture)))
        for i in range(0, len(picture), 64 * 1024):
            s.sendall(picture[i:i + 64 * 1024])
            time.sleep(0.3)
        got = read_all(s, 10)
    assert got.startswith(b"HTTP/1.1 200"), got[:300]

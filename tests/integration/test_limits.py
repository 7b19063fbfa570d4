"""Connection and protocol limits, and liveness that does not depend on client load, in
a real uvicorn process: slow clients are cut at their deadlines, a connection flood makes
room for real clients without exhausting descriptors, CPU work never runs on the event loop, and the
probe listener answers while clients hold every slot, yet reports a stalled loop."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import psutil
import pytest

from services.runtime.edge.connection_room import PACE_S
from tests.images import small_png
from tests.service_harness import ServiceProcess, probe

APP = "tests.children.edge_app:create_app"  # the scripted service and the edge routes
PNG = small_png()


def _read_until_closed(s: socket.socket, limit_s: float) -> bytes:
    s.settimeout(limit_s)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
    except TimeoutError:
        raise AssertionError(f"connection still open after {limit_s} s; got {data[:200]!r}") from None


def _read_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length: its head and body may come in several reads."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before the response head ended: {data[:100]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed before the response body ended"
        body += chunk
    assert len(body) == length, "more bytes than the response announced"
    return head + b"\r\n\r\n" + body


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


QUEUE_S = 1.5  # under the uploads' body deadline: a newcomer in line gets its 503 before a place comes free


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    settings = {"header_timeout_s": 1.0, "body_timeout_s": 4.0, "max_connections": 40, "loop_stall_s": 0.6,
                "max_queue": 4, "max_batch_size": 1, "cpu_workers": 2, "connection_queue_timeout_s": QUEUE_S}
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("limits"), soft_nofile=256) as s:
        yield s


def test_a_client_that_sends_nothing_is_closed_at_the_header_deadline(svc):
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        data = _read_until_closed(s, 10)
    assert _status(data) == 408 and b"request_timeout" in data


def test_trickled_headers_are_cut_at_the_header_deadline(svc):
    """uvicorn alone resets its timer on every byte: one byte every 0.2 s held it forever."""
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        s.settimeout(0.05)
        got = b""
        while time.monotonic() - t0 < 10:
            try:
                s.sendall(b"X")
            except OSError:
                break  # closed by the server
            try:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            except TimeoutError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("a trickling client still held its connection after 10 s")
    assert got.startswith(b"HTTP/1.1 408")


def test_a_trickled_second_request_on_a_kept_alive_connection_is_cut(svc):
    request = (b"POST /api/v1/echo?id=ka HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
               + f"Content-Length: {len(PNG)}\r\n\r\n".encode() + PNG)
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(request)
        s.settimeout(10)
        first = _read_response(s)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        t0 = time.monotonic()
        for byte in request[:60]:  # the next request, one byte every 0.2 s
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
            if time.monotonic() - t0 > 10:
                raise AssertionError("a trickling second request held the connection for 10 s")
        data = _read_until_closed(s, 10)
    assert data.startswith(b"HTTP/1.1 408"), data[:100]


def test_a_slow_but_timely_body_is_accepted(svc):
    """The body has its own deadline (4 s here), longer than the headers' (1 s)."""
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(b"POST /api/v1/echo?id=slowbody HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  + f"Content-Length: {len(PNG)}\r\nConnection: close\r\n\r\n".encode())
        step = len(PNG) // 8 + 1
        for i in range(0, len(PNG), step):  # about 2 s in all
            s.sendall(PNG[i:i + step])
            time.sleep(0.25)
        data = _read_until_closed(s, 10)
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


def test_a_trickled_body_is_cut_at_the_body_deadline(svc):
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  + f"Content-Length: {len(PNG)}\r\n\r\n".encode() + PNG[:10])
        t0 = time.monotonic()
        for i in range(10, len(PNG)):
            if time.monotonic() - t0 > 10:
                raise AssertionError("a trickling body still held its connection after 10 s")
            try:
                s.sendall(PNG[i:i + 1])
            except OSError:
                break
            time.sleep(0.1)
        data = _read_until_closed(s, 10)
    assert _status(data) == 408
    assert httpx.post(svc.url + "/api/v1/echo?id=after", content=PNG,
                      headers={"content-type": "image/png"}).status_code == 200


def test_a_connection_flood_makes_room_and_the_service_keeps_serving(svc):
    """300 connections that send half a head and hold it, against max_connections 40: a
    newcomer takes the place of an unfinished head only once it has waited FRESH_S (here the
    header deadline, 1 s, cuts them first), else it is refused (a 503 after a pause, or a
    plain close or a reset); a client that sends its whole request is served while the
    flood is held; descriptors stay bounded and every flood connection ends."""
    proc = psutil.Process(svc.proc.pid)
    fds_before = proc.num_fds()
    evicted_before, timed_out_before, refused_before = (
        _metric(svc, "onecard_connections_evicted_total"), _metric(svc, "onecard_requests_timed_out_total"),
        _metric(svc, "onecard_connections_refused_total"))
    flood = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\n")  # half-sent, held open
            flood.append(s)
        # every timer of a flood connection ends within 2 s of the last one (a refusal's pause, its
        # linger; the header deadline, the cut linger); 15 s is for a CI machine whose 2 cores run
        # 4 test workers (once 5 s were not enough, with 110 held: see _held for what they are)
        deadline = time.monotonic() + 15
        while proc.num_fds() >= fds_before + 2 * 40 + 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.num_fds() < fds_before + 2 * 40 + 20, _held(svc, proc, fds_before)
        r = httpx.post(svc.url + "/api/v1/echo?id=during-flood", content=PNG, headers={"content-type": "image/png"},
                       timeout=10)
        assert r.status_code == 200, r.text
        # the probe listener does not share the public port's connections
        assert probe(svc.probe_socket, "/healthz")[0] == 200
        assert probe(svc.probe_socket, "/readyz")[0] == 200
        # the flood is still held open, but past its header deadline (1 s) and the brief linger
        # of a connection the edge cut (evicted ones too: a client's 5 s linger held 40 more)
        deadline = time.monotonic() + 10
        while proc.num_fds() > fds_before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.num_fds() <= fds_before + 5, _held(svc, proc, fds_before)
        outcomes = {"503": 0, "408": 0, "closed": 0}
        for s in flood:  # every one ends: made room for a newcomer, or cut at its header deadline
            try:
                data = _read_until_closed(s, 5)
            except ConnectionResetError:
                outcomes["closed"] += 1
                continue
            if data == b"":  # closed to make room before its head was read
                outcomes["closed"] += 1
            elif data.startswith(b"HTTP/1.1 503") and b"too_many_connections" in data:
                outcomes["503"] += 1
            elif data.startswith(b"HTTP/1.1 408"):
                outcomes["408"] += 1
            else:
                raise AssertionError(f"unexpected answer {data[:100]!r}")
        # at most 300 - 40 + 1 newcomers found the port full; the others were cut at 1 s
        assert outcomes["408"] >= 39 and sum(outcomes.values()) == 300, outcomes
    finally:
        for s in flood:
            s.close()
    time.sleep(0.3)
    r = httpx.post(svc.url + "/api/v1/echo?id=after-flood", content=PNG, headers={"content-type": "image/png"})
    assert r.status_code == 200
    evicted = _metric(svc, "onecard_connections_evicted_total") - evicted_before
    timed_out = _metric(svc, "onecard_requests_timed_out_total") - timed_out_before
    refused = _metric(svc, "onecard_connections_refused_total") - refused_before
    assert evicted + timed_out + refused >= 300, (evicted, timed_out, refused)


def test_a_newcomer_is_refused_only_when_every_connection_has_a_request_in_progress(svc):
    """40 uploads in progress (each still sending) fill max_connections: none of them is closed
    to make room, the newcomer gets 503 too_many_connections (and reads it), and once they are
    gone the service serves again."""
    refused_before = _metric(svc, "onecard_connections_refused_total")
    uploads = []
    sending = threading.Event()

    def keep_sending() -> None:  # a byte of each body every 0.2 s: none of them stalls
        while sending.is_set():
            for s in uploads:
                s.send(b"\x00")
            time.sleep(0.2)

    trickle = threading.Thread(target=keep_sending, daemon=True)
    try:
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(f"POST /api/v1/echo?id=up{i} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                      f"Content-Length: 60000\r\n\r\n".encode() + PNG)
            uploads.append(s)
        sending.set()
        trickle.start()
        time.sleep(1.2)  # past STALLED_BODY_S: they are not stalled, they are sending (body deadline: 4 s)
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", svc.port)) as s:  # its body is still to come
            s.sendall(b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                      b"Content-Length: 60000\r\n\r\n" + PNG)
            data = _read_until_closed(s, 5)
        assert data.startswith(b"HTTP/1.1 503") and b"too_many_connections" in data, data[:200]
        # told once it waited in line for connection_queue_timeout_s (no place came free)
        assert time.monotonic() - t0 >= QUEUE_S - 0.05, time.monotonic() - t0
        # a newcomer whose whole request is in when it is accepted (a probe, a small upload) is
        # answered beyond the limit, then closed; so is one whose request comes after it was
        # accepted (refused, its 503 waits a moment, and the request arrives meanwhile): a
        # GET /healthz is then answered at the door, needing no place, another is taken late
        at_door, late_taken = (_metric(svc, "onecard_probes_answered_at_the_door_total"),
                               _metric(svc, "onecard_connections_taken_late_total"))
        for late, request in ((0.0, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
                              (0.15, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
                              (0.15, b"GET /wait?s=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")):
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", svc.port)) as s:
                time.sleep(late)  # accepted (and refused) before its bytes came
                s.sendall(request)  # a probe does not say close: it is closed after its answer anyway
                answer = _read_until_closed(s, 5)
            assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower(), (late, answer)
            if b"healthz" in request:  # the route's own document and instance header, wherever answered
                assert b'"status":"ok"' in answer and f"x-onecard-instance: {svc.instance}".encode() in answer, answer
            print(f"{request[:12]!r} {late} s late answered in {time.monotonic() - t0:.3f} s")
        assert _metric(svc, "onecard_probes_answered_at_the_door_total") >= at_door + 1
        assert _metric(svc, "onecard_connections_taken_late_total") >= late_taken + 1
        sending.clear()
        trickle.join()
        for s in uploads:  # untouched: nobody made room by answering or closing an upload
            s.setblocking(False)
            try:
                got = s.recv(100)
            except BlockingIOError:
                continue
            raise AssertionError(f"an upload in progress was answered or closed to make room: {got!r}")
    finally:
        sending.clear()
        if trickle.is_alive():
            trickle.join()
        for s in uploads:
            s.close()
    time.sleep(0.3)
    assert _metric(svc, "onecard_connections_refused_total") >= refused_before + 1
    assert httpx.post(svc.url + "/api/v1/echo?id=after-uploads", content=PNG,
                      headers={"content-type": "image/png"}).status_code == 200


def test_bodies_their_clients_stopped_sending_make_room_for_a_newcomer(svc):
    """40 clients send a head with Expect: 100-continue, read the 100 and then send no body:
    they fill max_connections with requests in progress. Once a body has stalled past
    STALLED_BODY_S, a newcomer takes its place (the stalled one gets 408 body_stalled, the
    newcomer its answer), instead of a 503 for everyone until their body deadline."""
    from services.runtime.edge.connection_room import STALLED_BODY_S
    stalled = []
    try:
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.settimeout(5)
            s.sendall(f"POST /api/v1/echo?id=st{i} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                      f"Content-Length: 60000\r\nExpect: 100-continue\r\n\r\n".encode())
            assert s.recv(64).startswith(b"HTTP/1.1 100")
            stalled.append(s)
        time.sleep(STALLED_BODY_S + 0.5)
        t0 = time.monotonic()
        # (not /healthz: the door may answer that one as it accepts it, without a place)
        r = httpx.get(svc.url + "/wait?s=0", timeout=5)
        assert r.status_code == 200, r.text
        first = _read_until_closed(stalled[0], 5)  # the one stalled the longest made room
        assert first.startswith(b"HTTP/1.1 408") and b"body_stalled" in first, first[:200]
        # its place was the newcomer's at once; it was told after a pause (its reconnect waits)
        assert time.monotonic() - t0 >= PACE_S[0], time.monotonic() - t0
    finally:
        for s in stalled:
            s.close()
    time.sleep(0.3)
    still = httpx.post(svc.url + "/api/v1/echo?id=after-stalled", content=PNG, headers={"content-type": "image/png"})
    assert still.status_code == 200


def test_a_body_is_not_stalled_before_its_100_continue_is_sent(svc):
    """The service reads an Expect: 100-continue upload 1.5 s after its head (a request waiting
    its turn): its stall is counted from the 100, not from the head, so a newcomer arriving
    just after the 100 while the port is full does not take its place."""
    holders = []
    try:
        up = socket.create_connection(("127.0.0.1", svc.port))
        holders.append(up)
        up.settimeout(5)
        up.sendall(f"POST /late_read?s=1.5 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                   f"Content-Length: {len(PNG)}\r\nExpect: 100-continue\r\n\r\n".encode())
        for i in range(39):  # the rest of the port: requests in progress for 10 s
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(f"GET /wait?s=10&tag=h{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            holders.append(s)
        assert up.recv(64).startswith(b"HTTP/1.1 100")  # 1.5 s after the head
        newcomer = socket.create_connection(("127.0.0.1", svc.port))  # a head, its body still to come
        holders.append(newcomer)
        newcomer.sendall(b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n")
        time.sleep(0.5)  # in line: no place for it (the upload's body is owed for 0.5 s, not 2)
        up.sendall(PNG)
        answer = b""
        while b"}" not in answer:  # the head and the body may come in two pieces
            piece = up.recv(4096)
            assert piece, answer
            answer += piece
        assert answer.startswith(b"HTTP/1.1 200") and f'"bytes":{len(PNG)}'.encode() in answer, answer[:300]
    finally:
        for s in holders:
            s.close()


def _held(svc, proc: psutil.Process, fds_before: int) -> str:
    """What a service holds, for a failure's message: its descriptors, the states of its port's
    sockets (the kernel's view) and its connection counters (its own)."""
    import collections
    import subprocess
    ss = subprocess.run(["ss", "-tanH", f"sport = :{svc.port}"], capture_output=True, text=True).stdout
    states = collections.Counter(line.split()[0] for line in ss.splitlines() if line.strip())
    counters = [line for line in httpx.get(svc.url + "/metrics", timeout=10).text.splitlines()
                if line.startswith(("onecard_connections", "onecard_unread_answer", "onecard_requests_timed_out"))]
    return f"{proc.num_fds()} descriptors ({fds_before} before), sockets {dict(states)}, {counters}"


def _metric(svc, name: str) -> float:
    for line in httpx.get(svc.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_open_files_limit_is_raised_to_the_hard_limit(svc):
    """Started with a soft limit of 256 (the fixture), the service raises it itself."""
    soft, hard = psutil.Process(svc.proc.pid).rlimit(psutil.RLIMIT_NOFILE)
    assert hard > 256 and soft == hard


def test_decode_and_encode_never_run_on_the_event_loop(svc):
    """The decode hook sleeps 2 s; on the loop that would stall /healthz for 2 s each."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(httpx.post, svc.url + f"/api/v1/echo?id=slow{i}&decode_sleep=2", content=PNG,
                            headers={"content-type": "image/png"}, timeout=30) for i in range(2)]
        time.sleep(0.3)
        waits = []
        for _ in range(10):
            t0 = time.perf_counter()
            r = httpx.get(svc.url + "/healthz", timeout=1.0)  # a loop busy decoding misses this
            waits.append(time.perf_counter() - t0)
            assert r.status_code == 200
            time.sleep(0.1)
        assert all(f.result().status_code == 200 for f in slow)


def test_probes_answer_while_every_slot_is_busy(svc):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(httpx.post, svc.url + f"/api/v1/echo?id=busy{i}&sleep=1.5", content=PNG,
                            headers={"content-type": "image/png"}, timeout=30) for i in range(8)]
        time.sleep(0.4)
        for _ in range(5):
            status, doc = probe(svc.probe_socket, "/healthz", timeout=1.0)
            assert status == 200 and doc["instance"] == svc.instance
            status, doc = probe(svc.probe_socket, "/stats", timeout=1.0)
            assert status == 200 and doc["queue_depth"] <= 4
        codes = sorted(f.result().status_code for f in busy)
    assert codes.count(503) >= 3 and codes.count(200) >= 2, codes


def test_a_stalled_event_loop_fails_health_on_the_probe_listener(svc):
    """The probe thread must not lie: it reports the main loop's heartbeat."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(httpx.get, svc.url + "/block?s=2.5", timeout=30)
        deadline = time.monotonic() + 2.2
        seen = None
        while time.monotonic() < deadline:
            status, doc = probe(svc.probe_socket, "/healthz", timeout=1.0)
            if status == 503:
                seen = doc
                break
            time.sleep(0.1)
        assert seen is not None and "event loop" in seen["reason"], seen
        assert blocker.result().status_code == 200
    time.sleep(0.3)
    assert probe(svc.probe_socket, "/healthz")[0] == 200


def test_a_client_leaving_mid_upload_is_not_an_internal_error(svc):
    before = httpx.get(svc.url + "/stats").json()["errors"]
    with socket.create_connection(("127.0.0.1", svc.port)) as s:
        s.sendall(b"POST /api/v1/echo?id=leaver HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b"\x89PNG" + b"\0" * 1000)
        time.sleep(0.3)
    time.sleep(0.3)
    assert httpx.get(svc.url + "/stats").json()["errors"] == before
    assert "unexpected error" not in svc.output()
    metrics = httpx.get(svc.url + "/metrics").text
    assert 'status="499"' in metrics


def test_a_body_refused_from_its_headers_is_read_and_dropped_so_the_client_gets_its_answer(svc):
    """A client that sends its whole body before reading (as httpx, requests and curl do) and
    is refused from its Content-Length alone reads the 413, not a reset: the connection
    lingers after the answer and what the client still sends is dropped."""
    body = b"\0" * (30 * 2**20)  # over the 20 MiB limit, and far more than the kernel's queues hold
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", svc.port), timeout=30) as s:
            s.sendall(b"POST /api/v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body))
            s.sendall(body)  # a reset would raise here (or at the recv below)
            answer = _read_until_closed(s, 30)
        assert _status(answer) == 413 and b'"body_too_large"' in answer, answer[:300]
    assert httpx.get(f"http://127.0.0.1:{svc.port}/healthz", timeout=10).status_code == 200


def test_concurrent_uploads_take_turns_and_every_one_is_read_whole(svc):
    """Twelve 6 MB uploads at once: at most a few resume reading in one turn of the event loop
    (the others in the turns after, counted in /metrics), and every body still arrives whole:
    each is answered what is decided only once all of it is in (not a picture, or the queue
    full: max_queue 4), none cut or left unanswered. They arrive while the loop is held
    (GET /block), so that all of them have a backlog when it turns again."""
    body = bytes(6 << 20)   # nothing a decoder knows
    before = _metric(svc, "onecard_upload_reads_deferred_total")

    def upload(i):
        return httpx.post(svc.url + f"/api/v1/echo?id=turns{i}", content=body,
                          headers={"content-type": "image/png"}, timeout=60)

    # On a loaded machine the twelve clients can take longer to start than the hold, and then
    # arrive one by one: up to three tries for a turn with several backlogs at once.
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(13) as pool:
            held = pool.submit(httpx.get, svc.url + "/block?s=1.5", timeout=30)  # long enough on a busy machine
            time.sleep(0.1)
            answers = list(pool.map(upload, range(12)))
            assert held.result().status_code == 200
        codes = {(r.status_code, r.json()["error"]["code"]) for r in answers}
        assert codes <= {(415, "unsupported_image"), (503, "overloaded")} and (415, "unsupported_image") in codes, \
            codes
        if _metric(svc, "onecard_upload_reads_deferred_total") > before:
            break
    assert _metric(svc, "onecard_upload_reads_deferred_total") > before


HOLD_S = 1.5


def _flood_then_probe_while_held(svc) -> tuple[int, bool]:
    """30 requests for a 2 MiB answer, then a /healthz, sent while GET /block holds the loop:
    how many of theirs were out when the probe's answer came, and whether the probe was sent
    in time (within the hold, with a margin: on a loaded machine the sending can outlast it)."""
    flood = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        held = pool.submit(httpx.get, svc.url + f"/block?s={HOLD_S}", timeout=30)
        time.sleep(0.2)
        try:
            for i in range(30):
                s = socket.create_connection(("127.0.0.1", svc.port))
                s.sendall(f"GET /big?mb=2&i={i} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                flood.append(s)
            with socket.create_connection(("127.0.0.1", svc.port)) as p:
                p.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                in_time = time.monotonic() - t0 < HOLD_S - 0.3
                p.settimeout(10)
                answer = p.recv(4096)
                answered_before = 0
                for s in flood:  # which of theirs were already out when the probe's came
                    try:
                        answered_before += bool(s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
                    except BlockingIOError:
                        pass
            assert answer.startswith(b"HTTP/1.1 200"), answer
            for s in flood:
                s.settimeout(10)
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 20):  # each answer read whole (2 MiB, each built by its own request)
                    pass
        finally:
            for s in flood:
                s.close()
        assert held.result().status_code == 200
    return answered_before, in_time


def test_a_probe_is_answered_ahead_of_requests_read_in_the_same_turn(svc):
    """30 requests (each building a 2 MiB answer) and then a /healthz arrive while the loop is
    held (GET /block): when it turns again, all of them are read in one turn. At most a few
    start per turn, the probe at once, so its answer is out before most of theirs (before, it
    came after all 30). A try whose probe went out after the hold proves nothing (all 30 had
    started by then) and is made again."""
    before = _metric(svc, "onecard_request_starts_deferred_total")
    # The count is taken by this process after the probe's answer came: on a loaded machine it
    # can be descheduled meanwhile and count answers that came after. Up to three tries, the
    # fewest counts (with every one started at once, each try counts all 30).
    counts = []
    for _ in range(3):
        answered_before, in_time = _flood_then_probe_while_held(svc)
        if in_time:
            counts.append(answered_before)
            if answered_before < 20:
                break
    assert counts, "the probe never went out while the loop was held"
    print("answered before the probe:", counts)
    assert min(counts) < 20, counts
    assert _metric(svc, "onecard_request_starts_deferred_total") > before

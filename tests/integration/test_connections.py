"""The HTTP edge against hostile clients, on raw sockets to a real service process: request
heads counted as they arrive, pipelining that never loses or reorders an answer, body
framing bounded, half-closed clients, HTTP/1.0, Expect: 100-continue and upgrades.
Every case must end in a clear 4xx in the JSON envelope and a bounded cost, and the
service must answer the next client normally."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.images import small_png
from tests.service_harness import ServiceProcess

APP = "tests.children.edge_app:create_app"
PNG = small_png()
MAX_HEADER_BYTES = 4096


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    settings = {"header_timeout_s": 1.5, "body_timeout_s": 1.5, "max_header_bytes": MAX_HEADER_BYTES,
                "max_header_count": 20, "max_pipelined_requests": 4, "max_body_bytes": 64 * 1024,
                "max_batch_size": 1, "max_queue": 8, "cpu_workers": 2}
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("connections")) as s:
        yield s


def connect(svc, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", svc.port))
    s.settimeout(timeout)
    return s


def read_responses(s: socket.socket, count: int | None = None) -> list[tuple[int, dict, bytes]]:
    """Whole responses (with a Content-Length) until ``count`` or the connection closes."""
    data, out = b"", []
    while count is None or len(out) < count:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                assert not data, f"closed inside a response head: {data[:200]!r}"
                return out
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {k.strip().lower().decode(): v.strip().decode()
                   for k, _, v in (line.partition(b":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = s.recv(65536)
            assert chunk, "closed inside a response body"
            rest += chunk
        out.append((status, headers, rest[:length]))
        data = rest[length:]
        if status in (100,):
            out.pop()
    return out


def error_code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def still_serves(svc) -> None:
    r = httpx.post(svc.url + "/api/v1/echo?id=after", content=PNG, headers={"content-type": "image/png"}, timeout=10)
    assert r.status_code == 200, r.text


def metric(svc, name: str) -> float:
    for line in httpx.get(svc.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_an_endless_header_value_is_refused_within_one_read_past_the_limit(svc):
    """One 16 KiB piece of a header value without a line end: the parser has not finished
    the header, the bytes are counted anyway, and the 431 comes at once (uvicorn alone read
    43 MB of such a header and answered 408 at the header deadline)."""
    with connect(svc) as s:
        s.sendall(b"GET /wait?s=0 HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        time.sleep(0.1)
        s.sendall(b"v" * 16384)  # then nothing more: everything sent is read, no reset
        answers = read_responses(s)
    assert [a[0] for a in answers] == [431], answers
    assert error_code(answers[0][2]) == "headers_too_large"
    still_serves(svc)


@pytest.mark.parametrize("start,unit", [
    (b"GET /", b"a"),                                   # an endless URL
    (b"GET / HTTP/1.1\r\nX-A: 1\r\n", b"\r\n"[:1]),    # a bare CR run: never a header end
    (b"", b"\r\n"),                                     # blank lines before any request
])
def test_any_endless_head_gets_431_not_a_deadline(svc, start, unit):
    """Sent in one go, a head over the limit is answered at once (no wait for the 1.5 s deadline)."""
    with connect(svc) as s:
        s.sendall(start + unit * (MAX_HEADER_BYTES + 10))
        status, _, body = read_responses(s, 1)[0]
    assert status in (431, 400), status
    if status == 431:
        assert error_code(body) == "headers_too_large"


def test_the_head_of_a_single_read_is_counted_exactly(svc):
    """A head just under the limit, then its body in the same read: served."""
    filler = b"X-Fill: " + b"f" * (MAX_HEADER_BYTES - 300) + b"\r\n"
    req = (b"POST /api/v1/echo?id=near HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n" + filler
           + f"Content-Length: {len(PNG)}\r\n\r\n".encode() + PNG)
    with connect(svc) as s:
        s.sendall(req)
        status, _, body = read_responses(s, 1)[0]
    assert status == 200, body


def test_many_tiny_headers_are_refused_by_count(svc):
    head = b"GET /wait?s=0 HTTP/1.1\r\nHost: x\r\n" + b"".join(b"a%d: b\r\n" % i for i in range(21)) + b"\r\n"
    assert len(head) < MAX_HEADER_BYTES
    with connect(svc) as s:
        s.sendall(head)
        status, _, body = read_responses(s, 1)[0]
    assert status == 431 and "header fields" in json.loads(body)["error"]["message"]


def test_a_pipelined_request_behind_a_long_one_gets_its_deadline_after_the_first_answer(svc):
    """The second request's head is in, its body never comes: its 408 follows the first
    answer (2.5 s of model time, longer than its 1.5 s body deadline), never replaces it."""
    first = (b"POST /api/v1/echo?id=pipe1&sleep=2.5 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
             + f"Content-Length: {len(PNG)}\r\n\r\n".encode() + PNG)
    second = (b"POST /api/v1/echo?id=pipe2 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
              + f"Content-Length: {len(PNG)}\r\n\r\n".encode())  # the body is never sent
    with connect(svc, timeout=15) as s:
        s.sendall(first + second)
        answers = read_responses(s)
    assert [a[0] for a in answers] == [200, 408], [(a[0], a[2][:80]) for a in answers]
    assert json.loads(answers[0][2])["id"] == "pipe1"
    assert error_code(answers[1][2]) == "request_timeout"


def test_a_pipelined_partial_head_waits_its_turn_and_then_gets_its_own_deadline(svc):
    first = b"GET /wait?s=2.5&tag=one HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(svc, timeout=15) as s:
        s.sendall(first + b"GET /wait?s=0&tag=two HTTP/1.1\r\nHo")  # the rest of the head never comes
        answers = read_responses(s)
    assert [a[0] for a in answers] == [200, 408]
    assert json.loads(answers[0][2])["tag"] == "one"


def test_pipelined_requests_are_answered_in_order(svc):
    reqs = b"".join(b"GET /wait?s=%s&tag=t%d HTTP/1.1\r\nHost: x\r\n\r\n" % (s, i)
                    for i, s in enumerate([b"0.4", b"0", b"0.2", b"0"]))
    with connect(svc) as s:
        s.sendall(reqs)
        answers = read_responses(s, 4)
    assert [json.loads(a[2])["tag"] for a in answers] == ["t0", "t1", "t2", "t3"]


def test_a_flood_of_tiny_pipelined_requests_is_cut_after_the_limit(svc):
    """4 may wait behind the one being answered; the next gets 429 after their answers."""
    reqs = b"".join(b"GET /wait?s=0.3&tag=p%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(2000))
    with connect(svc, timeout=15) as s:
        s.sendall(reqs)
        answers = read_responses(s)
    statuses = [a[0] for a in answers]
    assert statuses == [200] * 5 + [429], statuses
    assert [json.loads(a[2])["tag"] for a in answers[:5]] == [f"p{i}" for i in range(5)]
    assert error_code(answers[5][2]) == "too_many_pipelined_requests"
    assert metric(svc, "onecard_pipelined_requests_refused_total") >= 1


@pytest.mark.parametrize("framing", [
    b"5;ext=",                                              # an endless chunk extension
    b"0000",                                                # an endless chunk-size line of zeros
    b"5\r\nhello\r\n0\r\nX-Trailer: ",                        # an endless trailer value
])
def test_a_chunked_bodys_endless_framing_is_refused_past_the_header_limit(svc, framing):
    """What a chunked body sends besides its data is bounded like a head: 431 within the read
    that passes max_header_bytes (4 KiB here). The parser keeps an unfinished trailer value
    whole: 16 connections sending one held 35 MB each, 550 MB of detect, until the body's wire
    cap (twice the body limit) cut them; extensions and zeros cost the loop its reads."""
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=framing HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + framing)
        time.sleep(0.1)
        s.sendall((b"0" if framing == b"0000" else b"e") * (MAX_HEADER_BYTES + 1024))  # then nothing
        answers = read_responses(s)
    assert [a[0] for a in answers] == [431], answers
    assert error_code(answers[0][2]) == "headers_too_large"
    assert b"chunk lines and trailer fields" in answers[0][2]
    assert "framing" not in httpx.get(svc.url + "/seen").json()["seen"]
    still_serves(svc)


def test_a_long_upload_in_small_chunks_is_not_taken_for_endless_framing(svc):
    """Framing is allowed per chunk: a real picture in 400-byte chunks, each with a 34-byte
    extension, sends 6 kB of chunk lines (over the 4 KiB header limit) and is served."""
    import numpy as np

    from tests.images import encode
    picture = encode(np.random.default_rng(1).integers(0, 255, (100, 160, 3), dtype=np.uint8))
    pieces = [picture[i:i + 400] for i in range(0, len(picture), 400)]
    body = b"".join(b"%x;note=%s\r\n" % (len(p), b"n" * 28) + p + b"\r\n" for p in pieces) + b"0\r\nX-Sum: 1\r\n\r\n"
    assert len(body) - len(picture) > MAX_HEADER_BYTES and len(picture) < 64 * 1024
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=manychunks HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for part in (body[:-64], body[-64:]):  # reads of their own: a read in the body's middle is counted
            time.sleep(0.1)
            s.sendall(part)
        answers = read_responses(s, 1)
    assert [a[0] for a in answers] == [200], answers
    assert "manychunks" in httpx.get(svc.url + "/seen").json()["seen"]


def test_a_chunk_size_that_overflows_is_400(svc):
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=ovf HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + b"F" * 40 + b"\r\n" + PNG)
        answers = read_responses(s)
    assert [a[0] for a in answers] == [400] and error_code(answers[0][2]) == "bad_request"
    still_serves(svc)


def test_a_huge_announced_chunk_is_cut_at_the_body_limit(svc):
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=bigchunk HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n7FFFFFFFFFFF\r\n" + b"\0" * (80 * 1024))
        status, _, body = read_responses(s, 1)[0]
    assert status == 413 and error_code(body) == "body_too_large"
    assert "bigchunk" not in httpx.get(svc.url + "/seen").json()["seen"]
    still_serves(svc)


def test_a_client_half_closing_inside_its_head_gets_400(svc):
    with connect(svc) as s:
        s.sendall(b"GET /wait?s=0 HTTP/1.1\r\nHost: x\r\n")
        s.shutdown(socket.SHUT_WR)
        answers = read_responses(s)
    assert [a[0] for a in answers] == [400] and error_code(answers[0][2]) == "incomplete_request"


def test_a_client_half_closing_inside_its_body_gets_400_and_costs_no_model_time(svc):
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=halfbody HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  + f"Content-Length: {len(PNG)}\r\n\r\n".encode() + PNG[:20])
        time.sleep(0.2)
        s.shutdown(socket.SHUT_WR)
        answers = read_responses(s)
    assert [a[0] for a in answers] == [400]
    assert "halfbody" not in httpx.get(svc.url + "/seen").json()["seen"]


def test_http_1_0_without_keep_alive_is_answered_and_closed(svc):
    with connect(svc) as s:
        s.sendall(b"GET /wait?s=0&tag=old HTTP/1.0\r\n\r\n")
        answers = read_responses(s)  # to the close: the server ends the connection
    assert len(answers) == 1 and answers[0][0] == 200 and json.loads(answers[0][2])["tag"] == "old"


def test_expect_100_continue_over_the_body_limit_is_413_before_any_body(svc):
    """No 100 Continue, so the client never sends the body it announced: the connection
    cannot carry another request and is closed after the 413 (said in the answer)."""
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=expect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  b"Content-Length: 10000000\r\nExpect: 100-continue\r\n\r\n")
        answers = read_responses(s)  # to the server's close
    assert [a[0] for a in answers] == [413] and error_code(answers[0][2]) == "body_too_large"
    assert answers[0][1]["connection"] == "close"
    still_serves(svc)


def test_expect_100_continue_within_the_limit_gets_continue_then_its_answer(svc):
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=cont HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  + f"Content-Length: {len(PNG)}\r\nExpect: 100-continue\r\n\r\n".encode())
        got = s.recv(64)
        assert got.startswith(b"HTTP/1.1 100"), got
        s.sendall(PNG)
        status, _, body = read_responses(s, 1)[0]
    assert status == 200 and json.loads(body)["id"] == "cont"


H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("upgrade", [H2C, H2C.replace(b"Upgrade: h2c", b"uPgRaDe:websocket")])
def test_an_upgrade_offer_is_ignored_and_the_request_read_whole_as_plain_http(svc, upgrade):
    """What curl --http2 sends to an http:// URL: httptools took the upgrade offer for the end
    of the request, and a POST's body was never read (a valid picture answered 400, empty)."""
    with connect(svc) as s:
        s.sendall(b"POST /api/v1/echo?id=h2c HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                  + f"Content-Length: {len(PNG)}\r\n".encode() + upgrade + b"\r\n" + PNG)
        status, _, body = read_responses(s, 1)[0]
        assert status == 200 and json.loads(body)["id"] == "h2c", body
        s.sendall(b"GET /wait?s=0&tag=next HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive, as plain HTTP/1.1
        status, _, body = read_responses(s, 1)[0]
        assert status == 200 and json.loads(body)["tag"] == "next"


def _png_saying(text: str) -> bytes:
    import io

    from PIL import Image, PngImagePlugin
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", text)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


def test_a_body_that_looks_like_an_upgrade_header_is_never_rewritten(svc):
    """The head's end cut between two reads: the next read is all body. Renamed in there, the
    picture was corrupted and the bytes the rename added were parsed as a request of their own
    (a request smuggled inside a body)."""
    body = _png_saying("x\r\nupgrade: h2c\r\nUPGRADE: h2c")
    head = (b"POST /api/v1/echo?id=body HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode())
    for cut in (1, 2, 3):
        with connect(svc) as s:
            s.sendall(head[:-cut])
            time.sleep(0.2)  # read apart
            s.sendall(head[-cut:] + body)
            status, _, answer = read_responses(s, 1)[0]
            assert status == 200 and json.loads(answer)["id"] == "body", (cut, answer)
            s.sendall(b"GET /wait?s=0&tag=next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            rest = read_responses(s)
            assert [(st, json.loads(b)["tag"]) for st, _, b in rest] == [(200, "next")], (cut, rest)


def test_an_upgrade_offer_in_the_second_read_of_a_head_is_ignored_too(svc):
    """A head longer than a segment (cookies) may come in two reads, its Upgrade header in the
    second: the body was not read and a valid picture got 400 (empty), as in one read before
    the rename."""
    head = (b"POST /api/v1/echo?id=split HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            + f"Content-Length: {len(PNG)}\r\nCookie: {'c' * 1400}\r\n".encode())
    with connect(svc) as s:
        s.sendall(head)
        time.sleep(0.2)  # read apart
        s.sendall(H2C + b"\r\n" + PNG)
        status, _, body = read_responses(s, 1)[0]
        assert status == 200 and json.loads(body)["id"] == "split", body
        s.sendall(b"GET /wait?s=0&tag=next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert [(st, json.loads(b)["tag"]) for st, _, b in read_responses(s)] == [(200, "next")]


def test_an_upgrade_offer_costs_no_header_bytes(svc):
    """A head at exactly max_header_bytes with an Upgrade header is taken as it is without one
    (the renamed header is as long as the name it replaces): one byte over, 431 either way."""
    def status(upgrade: bytes, size: int) -> int:
        fixed = b"GET /wait?s=0&tag=edge HTTP/1.1\r\nHost: x\r\n" + upgrade + b"X-Pad: \r\nConnection: close\r\n\r\n"
        head = fixed.replace(b"X-Pad: ", b"X-Pad: " + b"p" * (size - len(fixed)))
        with connect(svc) as s:
            s.sendall(head)
            return read_responses(s)[0][0]
    size = MAX_HEADER_BYTES + 64  # the largest whole head taken without an Upgrade header
    while status(b"", size) != 200:
        size -= 1
        assert size > MAX_HEADER_BYTES - 200, "no head near the limit was taken"
    upgrade = b"Upgrade: h2c\r\n"
    assert (status(upgrade, size), status(upgrade, size + 1), status(b"", size + 1)) == (200, 431, 431)


def test_an_upgrade_header_split_across_reads_is_answered_as_plain_http_and_the_connection_closed(svc):
    with connect(svc) as s:
        s.sendall(b"GET /wait?s=0&tag=up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpg")
        time.sleep(0.3)  # read apart: the header is whole only in the parser
        s.sendall(b"rade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        answers = read_responses(s)
    assert [a[0] for a in answers] == [200] and json.loads(answers[0][2])["tag"] == "up"


def test_hostile_clients_at_once_leave_a_service_that_answers(svc):
    """Several of the above together, then ordinary requests: nothing was left stuck."""
    def endless():
        try:
            with connect(svc) as s:
                s.sendall(b"GET / HTTP/1.1\r\nX: ")
                for _ in range(200):
                    s.sendall(b"v" * 16384)
        except OSError:
            pass
    threads = [threading.Thread(target=endless) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for _ in range(3):
        still_serves(svc)

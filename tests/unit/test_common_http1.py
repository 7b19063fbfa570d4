"""common/http1.py on real stream pairs: a head counted as it arrives, one deadline for the
whole head, the request line, the error envelope, and the probes' GET. The servers that use
it are tested against real sockets in tests/integration/test_endpoints.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from common import http1


def _reader(*chunks: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    return reader


def test_a_head_ends_at_its_blank_line_and_the_first_bytes_are_noticed():
    seen = []

    async def main():
        reader = _reader(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nextra")
        return await http1.read_head(reader, timeout_s=1.0, on_first_bytes=lambda: seen.append(1))

    assert asyncio.run(main()) == b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" and seen == [1]


def test_a_head_over_the_limit_is_refused_within_one_read_past_it():
    async def main():
        reader = _reader(b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 100 + b"\r\n\r\n")
        await http1.read_head(reader, timeout_s=1.0, limit=64)

    with pytest.raises(http1.HeadTooLarge):
        asyncio.run(main())


@pytest.mark.parametrize("sent,started", [(b"", False), (b"GET / HT", True)])
def test_the_deadline_says_whether_a_request_had_started(sent, started):
    async def main():
        await http1.read_head(_reader(sent, eof=False), timeout_s=0.05)

    with pytest.raises(http1.HeadTimeout) as err:
        asyncio.run(main())
    assert err.value.started is started


def test_the_request_line():
    line = http1.parse_request_line(b"HEAD /readyz?x=1 HTTP/1.1\r\n\r\n")
    assert (line.method, line.path, line.version) == ("HEAD", "/readyz", "HTTP/1.1")
    with pytest.raises(http1.BadRequestLine):
        http1.parse_request_line(b"hello\r\n\r\n")


@pytest.mark.parametrize("target, path", [("http://127.0.0.1:7860/healthz", "/healthz"),
                                          ("HTTP://h/readyz?x=1", "/readyz"), ("http://h", "/"),
                                          ("/a://b", "/a://b"), ("ftp://h/healthz", "ftp://h/healthz"),
                                          ("http://h?x=/healthz", "/"), ("http://h#/healthz", "/")])
def test_an_absolute_form_target_gives_its_path(target, path):
    assert http1.parse_request_line(f"GET {target} HTTP/1.1\r\n\r\n".encode()).path == path


def test_an_error_answer_is_the_json_envelope_and_head_drops_the_body():
    answer = http1.error_answer(405, "method_not_allowed", "use GET", (("Allow", "GET, HEAD"),))
    data = http1.encode_answer(answer)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n") and b"\r\nAllow: GET, HEAD\r\n" in head
    assert json.loads(body) == {"error": {"code": "method_not_allowed", "message": "use GET"}}
    assert http1.encode_answer(answer, head_only=True) == head + b"\r\n\r\n"


class _Writer:
    def __init__(self):
        self.sent = b""
        self.closed = False

    def write(self, data):
        self.sent += data

    async def drain(self):
        pass

    def close(self):
        self.closed = True

    async def wait_closed(self):
        pass


def test_the_client_reads_status_headers_and_a_bounded_body():
    async def main(answer: bytes, max_body: int = 1024):
        writer = _Writer()
        try:
            return await http1.get(_reader(answer), writer, "/stats", host="h:1", max_body=max_body), writer
        finally:
            assert writer.closed

    got, writer = asyncio.run(main(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Onecard-Instance: t\r\n\r\n{}"))
    assert (got.status, got.headers["x-onecard-instance"], got.body) == (200, "t", b"{}")
    assert writer.sent.startswith(b"GET /stats HTTP/1.1\r\nHost: h:1\r\n")
    with pytest.raises(http1.BodyTooLarge):
        asyncio.run(main(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n", max_body=100))
    with pytest.raises(http1.BadStatusLine):
        asyncio.run(main(b"SSH-2.0-OpenSSH\r\n\r\n"))

"""The small part of HTTP/1.1 that probes speak: one request per connection, GET or HEAD,
no body. Every probe server and the probe client use these pieces, so that a limit, a
deadline or the error envelope is written once.

A server reads a request head with `read_head` (a byte limit counted as bytes arrive, and
one deadline for the whole head that a trickle of bytes never resets), takes its first
line apart with `parse_request_line`, and answers with `send_answer`; errors go out in the
JSON envelope ``{"error": {"code": ..., "message": ...}}`` that `error_answer` builds.
What a server does past the limit or the deadline (431, 408, a silent close) is its own
choice: the exceptions say which case it is.

The client, `get`, is the minimal GET the supervisor's probes send over a connection the
caller opened (a unix socket or TCP): the answer's status, headers and a body of at most
`max_body` bytes.

Standard library only (asyncio streams): the supervisor's lean process imports it.
"""

from __future__ import annotations

import asyncio
import http
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

MAX_HEAD = 8 * 1024       # a probe's request head: a request line and a few headers
READ_CHUNK = 4096
HEAD_END = b"\r\n\r\n"


# ---- server side ----------------------------------------------------------------------
class HeadTooLarge(Exception):
    """The head passed the limit (found within one read past it, however it was sent)."""


class HeadTimeout(Exception):
    """The deadline passed before the head was complete; `started`: some bytes had come
    (a request that deserves a 408), else the client sent nothing (an idle connection)."""

    def __init__(self, started: bool):
        super().__init__("no complete request head in time")
        self.started = started


class BadRequestLine(ValueError):
    """The first line is not ``METHOD TARGET HTTP/x``."""


@dataclass(frozen=True)
class RequestLine:
    method: str
    target: str
    version: str

    @property
    def path(self) -> str:
        """The target's path: of an absolute-form target too (``GET http://host:7860/healthz``,
        what a client sends through a proxy; RFC 9112 3.2.2: a server must accept it)."""
        target = self.target
        scheme, sep, rest = target.partition("://")
        if sep and scheme.lower() in ("http", "https"):
            cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
            target = rest[cut:] if rest[cut:cut + 1] == "/" else "/" + rest[cut:]
        return target.split("?", 1)[0].split("#", 1)[0]


@dataclass(frozen=True)
class Answer:
    """What a server sends back: a status, a content type, the body, extra headers."""
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


async def _read_until_blank_line(reader: asyncio.StreamReader, got: bytearray, limit: int,
                                 on_first_bytes: Callable[[], None] | None) -> bytes:
    while True:
        chunk = await reader.read(READ_CHUNK)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(got), None)
        if not got and on_first_bytes is not None:
            on_first_bytes()
        got += chunk
        end = got.find(HEAD_END)
        if end >= 0 and end + len(HEAD_END) <= limit:
            return bytes(got[:end + len(HEAD_END)])
        if end >= 0 or len(got) > limit:
            raise HeadTooLarge()


async def read_head(reader: asyncio.StreamReader, *, timeout_s: float, limit: int = MAX_HEAD,
                    on_first_bytes: Callable[[], None] | None = None) -> bytes:
    """The request head up to its blank line. Raises HeadTooLarge, HeadTimeout, or
    asyncio.IncompleteReadError when the client closes first. `on_first_bytes` is called
    once, when the first bytes arrive (a connection that has started a request)."""
    got = bytearray()
    try:
        return await asyncio.wait_for(_read_until_blank_line(reader, got, limit, on_first_bytes), timeout_s)
    except TimeoutError:
        raise HeadTimeout(started=bool(got)) from None


def parse_request_line(head: bytes) -> RequestLine:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise BadRequestLine("expected 'METHOD /path HTTP/1.1'")
    return RequestLine(*parts)


def json_answer(status: int, doc: object, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    return Answer(status, "application/json", json.dumps(doc).encode(), headers)


def error_answer(status: int, code: str, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    """The JSON error envelope every onecard endpoint answers with."""
    return json_answer(status, {"error": {"code": code, "message": message}}, headers)


def encode_answer(answer: Answer, head_only: bool = False) -> bytes:
    """The whole response; the connection closes after it (one request per connection)."""
    try:
        reason = http.HTTPStatus(answer.status).phrase
    except ValueError:
        reason = ""
    extra = "".join(f"{name}: {value}\r\n" for name, value in answer.headers)
    head = (f"HTTP/1.1 {answer.status} {reason}\r\nContent-Type: {answer.content_type}\r\n"
            f"Content-Length: {len(answer.body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode("latin-1") + (b"" if head_only else answer.body)


async def send_answer(writer: asyncio.StreamWriter, answer: Answer, *, timeout_s: float,
                      head_only: bool = False) -> None:
    """Write the answer; TimeoutError when the client does not read it within timeout_s."""
    writer.write(encode_answer(answer, head_only))
    await asyncio.wait_for(writer.drain(), timeout_s)


# ---- client side ----------------------------------------------------------------------
class BadStatusLine(ValueError):
    def __init__(self, line: str):
        super().__init__(f"bad status line {line[:80]!r}")
        self.line = line


class BodyTooLarge(ValueError):
    def __init__(self, length: int, max_body: int):
        super().__init__(f"the answer has {length} bytes, over the {max_body} read")
        self.length = length
        self.max_body = max_body


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]   # lower-case names; a repeated header keeps its last value
    body: bytes


async def get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, *, host: str,
              max_body: int, user_agent: str = "onecard-probe") -> Response:
    """GET `path` over an open connection, which is closed afterwards. Open the stream with a
    `limit` above the longest head expected: a longer one raises asyncio.LimitOverrunError.
    Raises BadStatusLine, BodyTooLarge (a Content-Length over max_body), ValueError (a
    garbled number), asyncio.IncompleteReadError, OSError."""
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {user_agent}\r\n"
                     "Connection: close\r\n\r\n".encode("ascii"))
        await writer.drain()
        head = await reader.readuntil(HEAD_END)
        status_line, _, header_block = head.decode("latin-1").partition("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise BadStatusLine(status_line)
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in header_block.split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip():
                headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"]) if "content-length" in headers else None
        if length is not None and length > max_body:
            raise BodyTooLarge(length, max_body)
        body = await (reader.readexactly(length) if length is not None else reader.read(max_body))
        return Response(status, headers, body)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def whole_request(data: bytes) -> bool:
    """Is ``data`` exactly one request with nothing more to wait for: its head and all of its
    body, nothing after (no chunked body, no Expect: 100-continue, a Content-Length that reads
    as one number)?"""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = data[:end].lower()
    if b"\nexpect:" in head or b"\ntransfer-encoding:" in head:
        return False
    if b"\ncontent-length:" not in head:
        return len(data) == end + 4
    length = re.search(rb"\ncontent-length:[ \t]*(\d+)[ \t]*(?:\r|$)", head)
    return length is not None and len(data) == end + 4 + int(length.group(1))

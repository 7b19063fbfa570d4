"""uvicorn's httptools protocol with the limits uvicorn does not have.

uvicorn caps neither the connections it holds open, nor the size of a request's
headers, nor the time a client may take to send them: its keep-alive timer is reset by
every byte, so a client trickling one byte at a time holds a connection forever
(uvicorn issue 157). Here, per connection:

- beyond ``max_connections`` open connections a new one gets 503 and is closed (after a
  short, bounded linger so that the client reads the 503): at most twice max_connections
  client sockets exist, never descriptor exhaustion;
- request line plus headers over ``max_header_bytes``: 431, connection closed;
- a request must arrive within deadlines: headers within ``header_timeout_s`` of its
  first byte (or of the connection, for a client that sends nothing), its body within
  ``body_timeout_s`` of the headers; else 408 and the connection is closed;
- a request uvicorn cannot parse gets 400 in the JSON error envelope, not plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("onecard.service")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    max_header_bytes: int = 16 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0


class ConnectionStats:
    """Counters the service shows in /metrics (written on the event loop only)."""
    refused = 0
    timed_out = 0
    headers_too_large = 0
    bad_requests = 0


def error_bytes(status: int, code: str, message: str, extra_headers: bytes = b"") -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (STATUS_LINE[status] + b"content-type: application/json\r\n"
            + b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n"
            + extra_headers + b"\r\n" + body)


LINGER_S = 1.0
MAX_LINGERING = 1024
_lingering = [0]  # refused connections still draining, across the process (event loop thread only)


class _HeadersTooLarge(Exception):
    pass


def guarded_protocol(limits: ConnectionLimits, stats: type[ConnectionStats] = ConnectionStats) -> type:
    """A protocol class for uvicorn's ``http=`` setting, bound to these limits."""

    class GuardedHttpProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._refused = False
            self._lingers = False
            self._deadline: asyncio.TimerHandle | None = None
            self._header_bytes = 0
            self._in_headers = False

        # ---- connections ------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                self._refuse(transport)
                return
            super().connection_made(transport)
            self._arm(limits.header_timeout_s)

        def _refuse(self, transport: asyncio.Transport) -> None:
            """503, then a lingering close: half-close, drain what the client sends, close on
            its EOF or after LINGER_S. Closing with unread data would send a reset that
            destroys the 503 before the client reads it. Bounded: past MAX_LINGERING
            refused connections, close at once."""
            self._refused = True
            self.transport = transport
            stats.refused += 1
            transport.write(error_bytes(503, "too_many_connections",
                                        f"the service holds {limits.max_connections} connections; retry later",
                                        b"retry-after: 1\r\n"))
            if _lingering[0] >= min(MAX_LINGERING, limits.max_connections) or not transport.can_write_eof():
                transport.close()
                return
            _lingering[0] += 1
            self._lingers = True
            transport.write_eof()
            self._deadline = self.loop.call_later(LINGER_S, transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._refused:
                if self._lingers:
                    self._lingers = False
                    _lingering[0] -= 1
                return
            super().connection_lost(exc)

        def eof_received(self) -> bool | None:
            if self._refused:
                self.transport.close()
                return None
            return super().eof_received()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # drained and dropped while the refusal lingers
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except _HeadersTooLarge:
                self._fail(431, "headers_too_large",
                           f"request line and headers are over {limits.max_header_bytes} bytes")
                stats.headers_too_large += 1
            except httptools.HttpParserUpgrade:
                self._fail(400, "bad_request", "protocol upgrades are not supported")
            except httptools.HttpParserError as exc:
                if isinstance(exc.__context__, _HeadersTooLarge) or isinstance(exc.__cause__, _HeadersTooLarge):
                    stats.headers_too_large += 1
                    self._fail(431, "headers_too_large",
                               f"request line and headers are over {limits.max_header_bytes} bytes")
                else:
                    stats.bad_requests += 1
                    self._fail(400, "bad_request", "invalid HTTP request")

        def send_400_response(self, msg: str) -> None:
            self._fail(400, "bad_request", msg)

        def _fail(self, status: int, code: str, message: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                cycle = self.cycle
                # a previous request's finished response does not stop this one's error
                if cycle is None or not cycle.response_started or (cycle.response_complete and self._in_headers):
                    self.transport.write(error_bytes(status, code, message))
                self.transport.close()

        # ---- deadlines --------------------------------------------------------------
        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._on_deadline)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _on_deadline(self) -> None:
            self._deadline = None
            stats.timed_out += 1
            if self.cycle is not None and not self.cycle.response_complete and not self._in_headers:
                # the body did not arrive in time; the app sees a disconnect
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self._fail(408, "request_timeout", "the request did not arrive in time")

        # ---- parser callbacks -------------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            self._in_headers = True
            self._arm(limits.header_timeout_s)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > limits.max_header_bytes:
                raise _HeadersTooLarge()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._arm(limits.body_timeout_s)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

    return GuardedHttpProtocol

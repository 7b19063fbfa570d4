"""The probe port: a tiny HTTP/1.1 server for orchestrator probes (/healthz, /readyz,
/metrics) and nothing else.

It is what the network reaches, so it must answer a kubelet at once whatever other clients
do: a bounded number of connections (`health_max_clients`) where idle ones make room for
newcomers (connections.py), a deadline for the whole request head (`health_idle_timeout_s`,
never reset by a trickle of bytes), a head of at most 8 KiB (431 past it), and every error
in the JSON envelope ``{"error": {"code": ..., "message": ...}}``. By default it listens on
every interface, IPv4 and IPv6, so that the orchestrator reaches it on the pod's IP
whatever family the cluster uses.
"""

from __future__ import annotations

import asyncio
import errno
import http
import json
from typing import Callable

from supervisor.connections import Slots

MAX_HEAD = 8 * 1024
BACKLOG = 1024
ALL_INTERFACES = ("", "*")

Route = Callable[[], tuple[int, str, str]]


class HeadTooLarge(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader, got: bytearray, on_first: Callable[[], None]) -> bytes:
    """The request head, counted as it arrives: over MAX_HEAD within one read past it."""
    while True:
        chunk = await reader.read(4096)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(got), None)
        if not got:
            on_first()
        got += chunk
        end = got.find(b"\r\n\r\n")
        if end >= 0 and end + 4 <= MAX_HEAD:
            return bytes(got[:end + 4])
        if end >= 0 or len(got) > MAX_HEAD:
            raise HeadTooLarge()


class ProbePortError(Exception):
    """The probe port cannot be opened; `taken` when another process holds it."""

    def __init__(self, message: str, taken: bool = False):
        super().__init__(message)
        self.taken = taken


def error_body(status: int, code: str, message: str) -> tuple[int, str, str]:
    return status, "application/json", json.dumps({"error": {"code": code, "message": message}})


class HealthServer:
    """``routes`` maps a path to a function returning (status, content type, body)."""

    def __init__(self, host: str, port: int, routes: dict[str, Route],
                 on_refused: Callable[[int], None] = lambda n: None, max_clients: int = 512,
                 idle_timeout_s: float = 1.0):
        self.host, self.port, self.routes = host, port, routes
        self.on_refused = on_refused
        self.idle_timeout_s = idle_timeout_s
        self.slots = Slots(max_clients)
        self._server: asyncio.AbstractServer | None = None

    @property
    def max_clients(self) -> int:
        return self.slots.limit

    @property
    def refused(self) -> int:
        return self.slots.closed_early

    def where(self) -> str:
        return f"every interface, port {self.port}" if self.host in ALL_INTERFACES else f"{self.host}:{self.port}"

    async def start(self) -> None:
        host = None if self.host in ALL_INTERFACES else self.host
        try:
            self._server = await asyncio.start_server(self._handle, host, self.port, reuse_address=True,
                                                      limit=MAX_HEAD, backlog=BACKLOG)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                from supervisor.ports import port_holder
                holder = await asyncio.to_thread(port_holder, self.port)
                raise ProbePortError(f"supervisor.health_port: port {self.port} on {self.where()} is taken"
                                     + (f" by {holder}" if holder else ""), taken=True) from None
            if host is None:  # no IPv6 here: IPv4 alone is every interface there is
                self.host = "0.0.0.0"
                return await self.start()
            raise ProbePortError(f"cannot listen on {self.where()} for probes: {exc}") from None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except asyncio.TimeoutError:
                pass
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        before = self.refused
        if not self.slots.admit(writer):
            self.on_refused(self.refused)
            writer.transport.abort()
            return
        if self.refused != before:  # an idle one made room
            self.on_refused(self.refused)
        try:
            answer, method = await self._answer(reader, writer)
            if answer is not None:
                await self._send(writer, answer, head_only=method == "HEAD")
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            self.slots.leave(writer)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        got = bytearray()
        try:
            head = await asyncio.wait_for(_read_head(reader, got, lambda: self.slots.started(writer)),
                                          self.idle_timeout_s)
        except HeadTooLarge:
            return error_body(431, "headers_too_large", f"the request head is over {MAX_HEAD} bytes"), "GET"
        except asyncio.TimeoutError:
            if got:  # a started request: say why it ends (an idle connection just closes)
                return error_body(408, "request_timeout",
                                  f"no complete request within {self.idle_timeout_s:g} s"), "GET"
            return None, ""
        except asyncio.IncompleteReadError:
            return None, ""
        self.slots.working(writer)
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return error_body(400, "bad_request", "expected 'METHOD /path HTTP/1.1'"), "GET"
        method, target = parts[0], parts[1]
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return error_body(405, "method_not_allowed", f"{method[:16]} is not allowed here; use GET or HEAD"), "GET"
        route = self.routes.get(path)
        if route is None:
            return error_body(404, "not_found", f"this port answers only {', '.join(sorted(self.routes))}"), method
        return route(), method

    async def _send(self, writer: asyncio.StreamWriter, answer: tuple[int, str, str], head_only: bool) -> None:
        status, ctype, body = answer
        data = body.encode()
        extra = "Allow: GET, HEAD\r\n" if status == 405 else ""
        try:
            reason = http.HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                     f"{extra}Connection: close\r\n\r\n".encode() + (b"" if head_only else data))
        await asyncio.wait_for(writer.drain(), self.idle_timeout_s)

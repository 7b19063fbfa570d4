"""Probes on their own listener, in their own thread, as Triton serves health apart.

Client load cannot delay these answers: the listener runs its own event loop in its
own thread, on a unix socket the supervisor gave (``ONECARD_PROBE_SOCKET``, inside the
supervisor's private directory) and optionally a TCP ``probe_port``. Hostile clients
holding the public port's connections do not reach it.

Nor can clients holding the listener's own connections starve it: a connection must
send its request within ``IDLE_TIMEOUT_S``, and when all ``MAX_CLIENTS`` slots are
taken a newcomer takes the slot of the oldest connection that has sent nothing whole
yet, so a probe (which sends its request at once) is answered however many idle
holders come and go. A request head over ``MAX_REQUEST`` gets 431, a partial one at
the idle deadline 408, any method but GET/HEAD 405, all in the JSON error envelope.

So that a separate thread cannot make health lie, the service's /healthz also fails
when its main event loop has stopped turning (services.runtime.shell.heartbeat) and when
a model call is stuck: it reflects the loop that serves clients and the GPU worker, not
just this thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("onecard.service")
MAX_REQUEST = 8 * 1024
# A probe sends its whole request as soon as it connects; a connection that has not
# within this is an idle holder and is closed.
IDLE_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 2.0   # a client that does not read its answer is dropped
MAX_CLIENTS = 256
BACKLOG = 1024

# path -> () -> (status, content type, body bytes); called in the probe thread
ProbeRoute = Callable[[], tuple[int, str, bytes]]


def json_route(fn: Callable[[], tuple[int, dict]]) -> ProbeRoute:
    def route() -> tuple[int, str, bytes]:
        status, doc = fn()
        return status, "application/json", json.dumps(doc).encode()
    return route


class _Client:
    __slots__ = ("writer", "answering")

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.answering = False


class _HeadTooLarge(Exception):
    pass


def _error(status: int, code: str, message: str) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps({"error": {"code": code, "message": message}}).encode()


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class ProbeServer:
    """A tiny HTTP/1.0-style server (one request per connection) in a daemon thread."""

    def __init__(self, routes: dict[str, ProbeRoute], unix_path: str | None = None,
                 tcp: tuple[str, int] | None = None, max_clients: int = MAX_CLIENTS,
                 idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.routes = routes
        self.unix_path = unix_path
        self.tcp = tcp
        self.max_clients = max_clients
        self.idle_timeout_s = idle_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._clients: dict[_Client, None] = {}  # insertion order: the oldest first
        self.served = 0
        self.evicted = 0

    def start(self) -> None:
        if self.unix_path is None and self.tcp is None:
            return
        self._thread = threading.Thread(target=self._main, name="onecard-probes", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"probe listener: {self._error}") from self._error

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(2)
        if self.unix_path:
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        servers = []
        try:
            if self.unix_path:
                try:
                    os.unlink(self.unix_path)
                except FileNotFoundError:
                    pass
                old = os.umask(0o177)
                try:
                    servers.append(loop.run_until_complete(asyncio.start_unix_server(
                        self._handle, path=self.unix_path, backlog=BACKLOG)))
                finally:
                    os.umask(old)
            if self.tcp:
                servers.append(loop.run_until_complete(asyncio.start_server(
                    self._handle, self.tcp[0], self.tcp[1], reuse_address=True, backlog=BACKLOG)))
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            # end every connection and handler on this loop before closing it: a transport
            # left to the garbage collector would complain from whatever thread frees it
            for server in servers:
                server.close()
            for client in list(self._clients):
                client.writer.transport.abort()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def _evict_idle(self) -> bool:
        """Free the slot of the oldest connection that has not sent a whole request."""
        for client in self._clients:
            if not client.answering:
                del self._clients[client]
                self.evicted += 1
                client.writer.transport.abort()
                return True
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = _Client(writer)
        if len(self._clients) >= self.max_clients and not self._evict_idle():
            writer.transport.abort()  # every slot is answering a probe right now
            return
        self._clients[me] = None
        head = bytearray()
        try:
            try:
                await asyncio.wait_for(self._read_head(reader, head), self.idle_timeout_s)
            except _HeadTooLarge:
                me.answering = True
                await self._reply(writer, "GET", *_error(431, "headers_too_large",
                                                         f"a probe request is at most {MAX_REQUEST} bytes"))
                return
            except TimeoutError:
                if head:  # sent part of a request: say why it is closed
                    me.answering = True
                    await self._reply(writer, "GET", *_error(408, "request_timeout",
                                                             "the probe request did not arrive in time"))
                return
            me.answering = True
            method, status, ctype, body = self._answer(bytes(head))
            self.served += 1
            await self._reply(writer, method, status, ctype, body)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._clients.pop(me, None)
            writer.close()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader, head: bytearray) -> None:
        while True:
            chunk = await reader.read(MAX_REQUEST)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(head), None)
            start = max(0, len(head) - 3)
            head += chunk
            end = head.find(b"\r\n\r\n", start)
            if end >= 0 and end + 4 <= MAX_REQUEST:
                return
            if len(head) > MAX_REQUEST:
                raise _HeadTooLarge()

    def _answer(self, head: bytes) -> tuple[str, int, str, bytes]:
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        route = self.routes.get(path)
        if method not in ("GET", "HEAD"):
            return (method, *_error(405, "method_not_allowed", "probes answer GET and HEAD only"))
        if route is None:
            return (method, *_error(404, "not_found", "no such probe"))
        try:
            return (method, *route())
        except Exception as exc:  # noqa: BLE001 - a probe must answer, even about itself
            log.exception("probe %s failed", path)
            return (method, *_error(500, "internal_error", str(exc)[:200]))

    async def _reply(self, writer: asyncio.StreamWriter, method: str, status: int, ctype: str, body: bytes) -> None:
        writer.write(f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
                     f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + (b"" if method == "HEAD" else body))
        try:
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except TimeoutError:
            writer.transport.abort()

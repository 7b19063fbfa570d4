"""Probes on their own listener, in their own thread, as Triton serves health apart.

Client load cannot delay these answers: the listener runs its own event loop in its
own thread, on a unix socket the supervisor gave (``ONECARD_PROBE_SOCKET``, inside the
supervisor's private directory) and optionally a TCP ``probe_port``. Hostile clients
holding the public port's connections do not reach it.

So that a separate thread cannot make health lie, /healthz also fails when the
service's main event loop has stopped turning (a heartbeat it writes every 100 ms) and
when a model call is stuck: it reflects the loop that serves clients and the GPU
worker, not just this thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("onecard.service")
MAX_REQUEST = 8 * 1024
READ_TIMEOUT_S = 2.0
MAX_CLIENTS = 64

# path -> () -> (status, content type, body bytes); called in the probe thread
ProbeRoute = Callable[[], tuple[int, str, bytes]]


class Heartbeat:
    """The main event loop's pulse: ``age()`` is how long since it last ran a callback."""

    PERIOD_S = 0.1

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        def beat() -> None:
            self._last = time.monotonic()
            self._handle = loop.call_later(self.PERIOD_S, beat)
        beat()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def age(self) -> float:
        return time.monotonic() - self._last


def json_route(fn: Callable[[], tuple[int, dict]]) -> ProbeRoute:
    def route() -> tuple[int, str, bytes]:
        status, doc = fn()
        return status, "application/json", json.dumps(doc).encode()
    return route


class ProbeServer:
    """A tiny HTTP/1.0-style server (one request per connection) in a daemon thread."""

    def __init__(self, routes: dict[str, ProbeRoute], unix_path: str | None = None,
                 tcp: tuple[str, int] | None = None):
        self.routes = routes
        self.unix_path = unix_path
        self.tcp = tcp
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._clients = 0
        self.served = 0

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
                        self._handle, path=self.unix_path, limit=MAX_REQUEST)))
                finally:
                    os.umask(old)
            if self.tcp:
                servers.append(loop.run_until_complete(asyncio.start_server(
                    self._handle, self.tcp[0], self.tcp[1], limit=MAX_REQUEST, reuse_address=True)))
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            for server in servers:
                server.close()
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._clients >= MAX_CLIENTS:
            writer.close()
            return
        self._clients += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            route = self.routes.get(path)
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "application/json", b'{"error":{"code":"method_not_allowed","message":"GET only"}}'
            elif route is None:
                status, ctype, body = 404, "application/json", b'{"error":{"code":"not_found","message":"no such probe"}}'
            else:
                try:
                    status, ctype, body = route()
                except Exception as exc:  # noqa: BLE001 - a probe must answer, even about itself
                    log.exception("probe %s failed", path)
                    status, ctype, body = 500, "application/json", json.dumps(
                        {"error": {"code": "internal_error", "message": str(exc)[:200]}}).encode()
            self.served += 1
            writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
                         f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError):
            pass
        finally:
            self._clients -= 1
            writer.close()

"""The two ways in: a local-only control socket (full status) and the probe port.

The control socket lives in a 0700 directory and is itself 0600, so only the user the
supervisor runs as can read the full status. The probe port answers /healthz, /readyz
and /metrics and nothing else: it is what an orchestrator reaches over the network.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any, Callable

MAX_REQUEST = 8 * 1024
REQUEST_TIMEOUT_S = 5.0


class ControlError(Exception):
    pass


def prepare_socket_path(path: str) -> None:
    """A private directory, and no stale socket from a supervisor that died."""
    p = Path(path)
    d = p.parent
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise ControlError(f"{d}: owned by uid {st.st_uid}, not by us; refusing to use it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise ControlError(f"{p}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(str(p))
        except OSError:
            p.unlink()  # stale: its supervisor is gone
        else:
            raise ControlError(f"{p}: another onecard supervisor is running and answers there")
        finally:
            probe.close()


class _Server:
    _server: asyncio.AbstractServer | None = None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ControlServer(_Server):
    """Unix socket: a client sends one line (``status``), gets one JSON document back."""

    def __init__(self, path: str, snapshot: Callable[[], dict[str, Any]]):
        self.path = path
        self.snapshot = snapshot

    async def start(self) -> None:
        prepare_socket_path(self.path)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._handle, path=self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
            cmd = line.decode("ascii", "replace").strip()
            if cmd == "status":
                body = self.snapshot()
            else:
                body = {"error": f"unknown command {cmd[:40]!r}; expected 'status'"}
            writer.write(json.dumps(body).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            await super().close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


class HealthServer(_Server):
    """A tiny HTTP/1.1 server for orchestrator probes. ``routes`` maps a path to a
    function returning (status, content type, body)."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[], tuple[int, str, str]]]):
        self.host, self.port, self.routes = host, port, routes

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                      reuse_address=True, limit=MAX_REQUEST)
        except OSError as exc:
            raise ControlError(f"cannot listen on {self.host}:{self.port} for probes: {exc}") from None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", "method not allowed\n"
            elif path in self.routes:
                status, ctype, body = self.routes[path]()
            else:
                status, ctype, body = 404, "text/plain", "not found\n"
            data = body.encode()
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
                      503: "Service Unavailable"}.get(status, "")
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if method == "HEAD" else data))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError):
            pass
        finally:
            writer.close()

"""The local-only control socket (`onecard status`, `onecard stop`) and the supervisor's
private run directory.

Nothing here changes what the supervisor did not create: a missing directory is made
0700, an existing one is used as it is (pointing control_socket at /run/onecard.sock
leaves /run alone). The socket itself is 0600, which is what keeps other users out (a
unix socket needs write permission to connect). Everything else private (probe sockets,
MPS pipes) goes into the supervisor's own run directory, created 0700 by it.

The protocol is one line in, one JSON document out (not HTTP: `onecard status` is its only
client, and a line needs no parser). The probe port is probe_port.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from supervisor.config.settings import SupervisorSettings
from supervisor.servers.connection_slots import ClosableServer, Slots

MAX_REQUEST = 8 * 1024
REQUEST_TIMEOUT_S = 5.0   # to write an answer to a client that reads slowly
BACKLOG = 1024


class ControlError(Exception):
    """The control socket or run directory cannot be used (exit 1)."""


def _mkdirs_private(path: Path) -> bool:
    """Create path and any missing parent, each 0700 (only what we create); False if it existed."""
    if path.exists():
        return False
    if not path.parent.exists():
        _mkdirs_private(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return False
    return True


def _private_dir(path: Path, what: str) -> None:
    """Create path 0700 if missing; if it exists it must already be ours and private."""
    if _mkdirs_private(path):
        return
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{path}: exists and is not a directory ({what})")
    if st.st_uid != os.getuid():
        raise ControlError(f"{path}: owned by uid {st.st_uid}, not by us ({what}); remove it or choose another path")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ControlError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, expected a private 0700 directory "
                           f"({what}); remove it or choose another path")


def prepare_run_dir(path: str) -> None:
    _private_dir(Path(path), "the supervisor's run directory")
    for sub in ("probes",):
        _private_dir(Path(path) / sub, "probe sockets")


def prepare_socket_path(path: str) -> None:
    """The socket's directory exists (made 0700 if we make it), and no stale socket from
    a supervisor that died is in the way."""
    p = Path(path)
    d = p.parent
    _mkdirs_private(d)
    st = d.stat()
    if stat.S_IMODE(st.st_mode) & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise ControlError(f"{d}: writable by every user and not sticky: another user could replace the "
                           f"control socket; choose another supervisor.control_socket")
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


ControlHandler = Callable[[str], Awaitable[bytes]]


class ControlServer(ClosableServer):
    """Unix socket: a client sends one line (``status`` or ``stop``), gets one JSON document.

    Idle clients (connected, no command yet) have `idle_timeout_s` to send it and make room
    for newcomers when every slot is taken (connection_slots.py), so they never lock `onecard
    status` or `onecard stop` out."""

    COMMANDS = ("status", "stop")

    def __init__(self, settings: SupervisorSettings, handle: ControlHandler):
        self.path = settings.control_socket
        self.handle = handle
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound
        self.slots = Slots(settings.control_max_clients, fresh_s=0.0)  # local callers send at once
        self.idle_timeout_s = settings.control_idle_timeout_s

    async def start(self) -> None:
        prepare_socket_path(self.path)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._handle, path=self.path, limit=MAX_REQUEST,
                                                           backlog=BACKLOG)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        st = os.stat(self.path)
        self.identity = (st.st_dev, st.st_ino)

    def missing(self) -> bool:
        """True when our socket file is gone (called in the sampler thread: a stat, never
        on the loop). A socket someone else put there is left alone."""
        try:
            os.stat(self.path)
        except FileNotFoundError:
            return self.identity is not None
        except OSError:
            return False
        return False

    def present_elsewhere(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.identity

    async def recreate(self) -> None:
        """Bind the socket again at its path (after someone deleted it)."""
        await ClosableServer.close(self)
        await self.start()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.slots.admit(writer):
            self.slots.closed_early += 1
            writer.transport.abort()
            return
        try:
            line = await asyncio.wait_for(reader.readline(), self.idle_timeout_s)
            self.slots.working(writer)
            cmd = line.decode("ascii", "replace").strip()
            if cmd in self.COMMANDS:
                body = await self.handle(cmd)
            else:
                body = json.dumps({"error": f"unknown command {cmd[:40]!r}; expected one of "
                                            f"{', '.join(self.COMMANDS)}"}).encode()
            writer.write(body + b"\n")
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError, OSError):
            pass
        finally:
            self.slots.leave(writer)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            await super().close()
            if not self.present_elsewhere():
                try:
                    os.unlink(self.path)
                except OSError:
                    pass

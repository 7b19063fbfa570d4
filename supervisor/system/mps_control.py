"""The NVIDIA MPS control daemon, seen from the OS: its control binary, its pipe and log
directories, its control socket, and its process once it has detached.

`nvidia-cuda-mps-control -d` detaches: the daemon it leaves behind re-parents to the
supervisor (a child subreaper, or PID 1), which adopts it as the `mps` child: its death
while the unit runs stops the unit with exit 6, its exit is reaped, and after the last
service is gone it is told `quit` (SIGKILL after `mps_stop_timeout_s`). The control
client calls (`-d`, `quit`) are one-shot children of the supervisor, reaped like the
others, never a subprocess waited on elsewhere. A daemon that is already dead costs no
wait: its stale control socket is removed, nobody talks to it.

Everything here that touches the filesystem or the process table is synchronous and is
called in a worker thread by the driver.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import time
from pathlib import Path

BINARY = "nvidia-cuda-mps-control"


class MpsError(Exception):
    pass


class MpsControl:
    def __init__(self, base_dir: str, start_timeout_s: float = 10.0, stop_timeout_s: float = 10.0):
        self.base = Path(base_dir)
        self.pipe_dir = self.base / "pipe"
        self.log_dir = self.base / "log"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s

    @staticmethod
    def binary() -> str | None:
        return shutil.which(BINARY)

    def problem(self) -> str | None:
        """What stops MPS from starting, found without starting it (for `onecard check`)."""
        if self.binary() is None:
            return f"[gpu] mps = true, but {BINARY} is not on PATH ({os.environ.get('PATH', '')})"
        return None

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def argv(self, *args: str) -> list[str]:
        exe = self.binary()
        if exe is None:
            raise MpsError(self.problem())
        return [exe, *args]

    @property
    def control(self) -> Path:
        return self.pipe_dir / "control"

    def prepare(self) -> None:
        for d in (self.base, self.pipe_dir, self.log_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    def control_state(self) -> str:
        """'absent', 'live' (a daemon accepts on it) or 'stale' (left by a dead one)."""
        try:
            st = self.control.lstat()
        except FileNotFoundError:
            return "absent"
        if not stat.S_ISSOCK(st.st_mode):
            return "stale"
        for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
            s = socket.socket(socket.AF_UNIX, kind)
            s.settimeout(0.5)
            try:
                s.connect(str(self.control))
                return "live"
            except ConnectionRefusedError:
                return "stale"
            except OSError:
                continue  # wrong socket type: try the other one
            finally:
                s.close()
        return "stale"

    def remove_leftovers(self) -> None:
        if self.pipe_dir.is_dir():
            for leftover in self.pipe_dir.iterdir():
                try:
                    leftover.unlink()
                except (IsADirectoryError, OSError):
                    pass

    def wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.control_state() == "live" and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.control_state() != "live"

    def find_daemon(self, me: int, exclude: set[int]) -> int | None:
        """The detached daemon, once it has been re-parented to us (so that we reap it)."""
        import psutil
        try:
            kids = psutil.Process(me).children()
        except psutil.Error:
            return None
        for p in kids:
            if p.pid in exclude:
                continue
            try:
                cmd = p.cmdline()
                if p.status() == psutil.STATUS_ZOMBIE or not cmd:
                    continue
            except psutil.Error:
                continue
            if any(os.path.basename(part) == BINARY for part in cmd[:2]):
                return p.pid
        return None

    def wait_daemon(self, me: int, exclude: set[int], timeout: float) -> tuple[int | None, bool]:
        """(daemon pid or None, control socket up) within timeout."""
        deadline = time.monotonic() + timeout
        pid = None
        while True:
            if pid is None:
                pid = self.find_daemon(me, exclude)
            up = self.control_state() == "live"
            if pid is not None and up:
                return pid, True
            if time.monotonic() > deadline:
                return pid, up
            time.sleep(0.05)

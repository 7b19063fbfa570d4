"""A real redis-server for the tests: on a free port, in a temporary directory, stopped by
the test that started it, even when the test fails.

The binary is ``$ONECARD_TEST_REDIS_SERVER``, else ``redis-server`` on the PATH (Debian's
package; ./dev.sh installs it). A missing binary fails the test: these tests never pass
by not running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import free_port


def redis_binary() -> str:
    path = os.environ.get("ONECARD_TEST_REDIS_SERVER") or shutil.which("redis-server") \
        or next((p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.path.exists(p)), None)
    if not path:
        pytest.fail("redis-server not found: ./dev.sh installs Debian's redis-server, or set "
                    "ONECARD_TEST_REDIS_SERVER to a redis-server binary")
    return path


def ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, tmp: Path, aof: bool = False):
        self.dir = tmp / f"redis-{os.getpid()}-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        self.aof = aof
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]
        if self.aof:  # every write on disk before the reply: an accepted job survives a crash
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited {self.proc.returncode}:\n{self.log()}")
            if ping(self.port):
                return self
            time.sleep(0.02)
        raise AssertionError(f"redis-server did not answer PING in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def pause(self) -> None:
        """SIGSTOP: connections still open (the kernel completes them), nothing answers: a hung Redis."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no goodbye to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        self.kill()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Big submits and results checked in helper processes, their bytes moved through pipes a
slice at a time.

Parsing and re-encoding 30 MB of JSON holds the GIL for tens of milliseconds, so it runs in
another process. A ProcessPoolExecutor pickled each body in one call with the GIL held (its
queue feeder thread) and unpickled the answer the same way: 10 to 16 ms a 30 MB submit,
and 200 concurrent submits kept the jobs probes at 25 to 30 ms p99. Here a frame is a
small JSON head and the bytes: written with os.write in 1 MiB slices and read with
os.readv straight into the object that is handed back (services.runtime.codecs.
fresh_bytes), both with the GIL released. The child (services.jobs.helper_main) runs one
of a fixed table of functions; it ends when its pipe closes.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import threading
from typing import Any

from services.runtime.codecs.fresh_bytes import FreshBytes

log = logging.getLogger("onecard.jobs")

HEAD = struct.Struct(">IQ")   # the JSON head's length, the bytes' length
WRITE_SLICE = 1 << 20
MAX_HEAD = 1 << 20


class HelperGone(Exception):
    """The helper process died or broke the protocol: the call is made here instead."""


def send_frame(fd: int, head: dict[str, Any], data: bytes | memoryview = b"") -> None:
    meta = json.dumps(head).encode()
    view = memoryview(data).cast("B")
    _write_all(fd, HEAD.pack(len(meta), len(view)) + meta)
    for i in range(0, len(view), WRITE_SLICE):
        _write_all(fd, view[i:i + WRITE_SLICE])


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytes:
    if n >= 2:
        out = FreshBytes(n)
        out.fill_from(fd)
        return out.take()
    data = os.read(fd, n) if n else b""
    if len(data) != n:
        raise EOFError("the pipe closed")
    return data


def recv_frame(fd: int) -> tuple[dict[str, Any], bytes]:
    meta_len, data_len = HEAD.unpack(read_exact(fd, HEAD.size))
    if meta_len > MAX_HEAD:
        raise ValueError("a frame head over 1 MiB")
    return json.loads(read_exact(fd, meta_len)), read_exact(fd, data_len)


class HelperProcess:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "services.jobs.helper_main"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0, close_fds=True)
        self._to, self._from = self.proc.stdin.fileno(), self.proc.stdout.fileno()

    def call(self, fn: str, args: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
        try:
            send_frame(self._to, {"fn": fn, "args": args}, data)
            head, out = recv_frame(self._from)
        except (OSError, EOFError, ValueError, struct.error) as exc:
            self.kill()
            raise HelperGone(f"{type(exc).__name__}: {exc}") from None
        except BaseException:  # anything else mid-frame: out of step with it, so it goes now
            self.kill()
            raise
        if not head.get("ok"):
            raise RuntimeError(f"the helper process failed: {head.get('error')}")
        return head, out

    def kill(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


class HelperPool:
    """At most `size` helper processes, started on first use; a call blocks its thread."""

    def __init__(self, size: int = 2) -> None:
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[HelperProcess] = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, fn: str, args: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
        with self._slots:
            with self._lock:
                if self._closed:
                    raise HelperGone("shut down")
                helper = self._idle.pop() if self._idle else None
            if helper is None:
                helper = HelperProcess()
            result = helper.call(fn, args, data)  # HelperGone: that one is gone
            with self._lock:
                if self._closed:
                    helper.kill()
                else:
                    self._idle.append(helper)
            return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for helper in idle:
            helper.kill()

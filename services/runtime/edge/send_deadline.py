"""The send deadline: a client that takes none of its answer for ``send_timeout_s`` is reset.

What the app writes and the socket does not take waits in asyncio's transport buffer
(the whole rest of a 27 MB image), and the kernel keeps up to a few MiB more in the
socket's send queue; uvicorn would wait for such a client for ever. As nginx's
``send_timeout``, the deadline runs between two writes that make progress, not over
the whole answer: a slow link that keeps taking bytes is served, a client that stops
reading is cut. Progress is what leaves the transport buffer; the kernel only takes
more once the client has read a good part of its queue (a third of the send buffer),
so a client that reads one byte a second makes no progress and is cut too.

A cut is a TCP reset (``SO_LINGER`` 0), as nginx's ``reset_timedout_connection``:
a plain close would leave the kernel an orphan socket that keeps the unsent bytes and
probes the client's zero window for minutes. The same holds for a connection closed
with its last answer still in the kernel's queue (a keep-alive that expired while
the client read nothing): ``KernelQueueLinger`` keeps such a socket for as long as
its queue drains and resets it when it stops.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Callable

from common.socket_queues import unsent_bytes

# Sockets closed with more than this still unsent are watched; a smaller tail drains on
# its own or costs the kernel little.
LINGER_MIN_BYTES = 64 * 1024


FIRST_LOOK_S = 0.25  # after writing paused: what its client's window took meanwhile is seen


def tick_s(timeout_s: float) -> float:
    """How often progress is looked at: a cut comes at most a quarter late."""
    return min(1.0, max(0.05, timeout_s / 4))


def reset(transport: asyncio.BaseTransport) -> None:
    """Close with a TCP reset, so that the kernel drops the unsent bytes at once."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


def cap_send_buffer(transport: asyncio.BaseTransport, size: int) -> None:
    """The kernel's send queue of this connection held to ``size`` (Linux doubles it for its
    bookkeeping); 0 leaves the kernel's autotuning. Autotuned, a client that reads nothing let
    the kernel take 4 MiB of its answer before the service's writes paused: that much memory
    for each of 700 such connections, and 20 pieces of a job's result read and encoded for
    each by the service's workers (700 reconnecting: their GIL and the 2 cores kept the jobs
    /healthz p99 at 25-35 ms)."""
    sock = transport.get_extra_info("socket")
    if size and sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError:
            pass


class SendWatch:
    """One connection's writes while its transport is paused (its buffer over the high-water
    mark): ``on_stuck`` runs when nothing has left the buffer for ``timeout_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.WriteTransport,
                 timeout_s: float, on_stuck: Callable[[], None]):
        self._loop = loop
        self._transport = transport
        self._timeout_s = timeout_s
        self._tick_s = tick_s(timeout_s)
        self._on_stuck = on_stuck
        self._handle: asyncio.TimerHandle | None = None
        self._last_size = 0
        self._last_progress = 0.0
        self._queued_last = 0
        self._queued_taken = 0.0

    @property
    def active(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if self._handle is None:
            self._last_size = self._transport.get_write_buffer_size()
            self._last_progress = self._queued_taken = self._loop.time()
            self._queued_last = self._queued()
            self._handle = self._loop.call_later(min(self._tick_s, FIRST_LOOK_S), self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def last_taken(self) -> float:
        """When its client last took some of its answer, as of now (loop time): what the
        transport's buffer and the kernel's queue hold shrank. (The kernel asks for more only
        once half its queue is gone: a slow reader empties it for many seconds before the
        transport's buffer moves; the send deadline above counts that buffer alone.)"""
        self._look()
        return self._queued_taken

    def _look(self) -> None:
        """What is queued, looked at now and each tick: a shrink is dated to the look that saw
        it. Looked at only when asked, the queue of a client reading nothing, which shrinks once
        just after the writes pause (its receive window filling), was dated to the first
        question, 2 s on, and its connection made room only 2 s after that."""
        queued = self._queued()
        if queued < self._queued_last:
            self._queued_taken = self._loop.time()
        self._queued_last = queued

    def _queued(self) -> int:
        sock = self._transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        return self._transport.get_write_buffer_size() + (unsent_bytes(fd) if fd >= 0 else 0)

    def _tick(self) -> None:
        self._handle = None
        self._look()
        # a transport closing with bytes still buffered (a keep-alive that expired, a
        # Connection: close answer) waits for them: it is watched all the same
        size = self._transport.get_write_buffer_size()
        now = self._loop.time()
        if size < self._last_size:
            self._last_progress = now
        self._last_size = size
        if now - self._last_progress >= self._timeout_s:
            self._on_stuck()
            return
        self._handle = self._loop.call_later(self._tick_s, self._tick)


class KernelQueueLinger:
    """Sockets whose connection is over but whose kernel send queue still holds an answer.

    The connection's own descriptor is closed by asyncio right after ``connection_lost``;
    a duplicate keeps the socket, half-closed (the FIN follows the data), until its queue
    is empty, and resets it once the queue has not shrunk for ``timeout_s``. At most
    ``limit`` are kept: beyond, a socket with a large unread tail is reset at once (that
    many clients not reading is an attack, not a slow network)."""

    def __init__(self, timeout_s: float, limit: int):
        self.timeout_s = timeout_s
        self.limit = limit
        self.count = 0
        self.reset_total = 0

    def adopt(self, loop: asyncio.AbstractEventLoop, sock) -> None:
        """Called from ``connection_lost`` of a connection closed normally."""
        try:
            fd = sock.fileno()
        except (OSError, ValueError):
            return
        if fd < 0 or unsent_bytes(fd) <= LINGER_MIN_BYTES:
            return
        if self.count >= self.limit:
            self.reset_total += 1
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            return
        try:
            kept = socket.socket(fileno=os.dup(fd))
            kept.shutdown(socket.SHUT_WR)
        except OSError:
            return
        self.count += 1
        state = {"size": unsent_bytes(kept.fileno()), "progress": loop.time()}
        step = tick_s(self.timeout_s)

        def tick() -> None:
            size = unsent_bytes(kept.fileno())
            now = loop.time()
            if size <= 1:  # only the FIN, or nothing, left
                self._release(kept, reset=False)
                return
            if size < state["size"]:
                state["progress"] = now
            state["size"] = size
            if now - state["progress"] >= self.timeout_s:
                self._release(kept, reset=True)
                return
            loop.call_later(step, tick)

        loop.call_later(min(step, 0.05), tick)

    def _release(self, kept: socket.socket, reset: bool) -> None:
        self.count -= 1
        if reset:
            self.reset_total += 1
            try:
                kept.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        kept.close()

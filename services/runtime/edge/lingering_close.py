"""A lingering close for connections answered before their request body was read whole.

A request the service answers from its headers (413 for a declared size over the limit, 503
while the room its body would need is taken, 401) is answered and its connection closed
while the client is still sending the body. Closing a socket whose receive queue
holds unread bytes makes Linux send a reset instead of a FIN, and the reset destroys the
answer in the client's own queue: a client that sends its whole body before it reads (httpx,
requests, curl) sees "connection reset" instead of the 413 or the 503 that tells it what to
do. As nginx's ``lingering_close``, the socket is kept after the connection is over: its
side is shut (the FIN follows the answer), and what the client still sends is read and
dropped until it closes its side, stays silent for ``IDLE_S``, or ``TOTAL_S`` have passed.
Reads go into one reused buffer: nothing is kept. At most ``limit`` sockets linger; a new
one takes the place of the one lingering longest (it has had the most time to read its
answer), so clients that keep sending after their answer cannot make a newcomer's answer a
reset. A connection the edge itself cut (a deadline, a body too slow, a limit of the
protocol) lingers briefly (``CUT_TOTAL_S``): long enough for a client still sending to read
why it was cut (a 4 kB/s upload's 408 was sometimes a reset), no longer, as that client gets
little more of the service's time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Callable

from common.socket_queues import unread_bytes

IDLE_S = 5.0          # silence after which the client is taken to be gone (nginx: lingering_timeout)
TOTAL_S = 30.0        # the longest a socket lingers (nginx: lingering_time)
READ_BYTES = 1024 * 1024  # a big read per wake-up: few loop turns for a 30 MB tail
# Linux's TCP drops what a MSG_TRUNC read asks for without copying it out (tcp(7)): a 30 MB
# tail costs the loop its wake-ups, not 30 MB of copies
DISCARD = socket.MSG_TRUNC if sys.platform.startswith("linux") else 0
CUT_IDLE_S = 1.0      # the same, after the edge cut the connection
CUT_TOTAL_S = 2.0
# What all lingering sockets may drain in a second, together. Even untouched, each drained
# megabyte costs the loop its share of the kernel's work: clients that sent 18 MB bodies
# again and again after their 413 had the loop draining 4 GB/s, half of its time, and the
# probes waited. Past the rate a socket is read again only when the rate allows; a client
# sending its body regardless then takes longer to get to its answer, nothing more.
DRAIN_BYTES_PER_S = 256 * 1024 * 1024   # the setting lingering_drain_bytes_s
DRAIN_BURST_BYTES = 4 * READ_BYTES


class DrainRate:
    """A token bucket over the bytes drained: how long to wait before the next read."""

    def __init__(self, rate: float = DRAIN_BYTES_PER_S, burst: float = DRAIN_BURST_BYTES):
        self.rate, self.burst = rate, burst
        self._tokens, self._at = burst, None

    def spend(self, n: int, now: float) -> float:
        self._tokens = self._refilled(now) - n
        self._at = now
        return self.due(now)

    def due(self, now: float) -> float:
        """How long until there is something to spend (0: now)."""
        self._tokens, self._at = self._refilled(now), now
        return 0.0 if self._tokens > 0 else -self._tokens / self.rate

    def _refilled(self, now: float) -> float:
        return self._tokens if self._at is None else min(self.burst, self._tokens + (now - self._at) * self.rate)


class LingeringClose:
    def __init__(self, limit: int, idle_s: float = IDLE_S, total_s: float = TOTAL_S,
                 drain_bytes_s: float = DRAIN_BYTES_PER_S):
        self.limit, self.idle_s, self.total_s = limit, idle_s, total_s
        self.drained_bytes = 0
        self.cut_short = 0  # lingering sockets closed early to make room for a newer one
        self._buffer = bytearray(READ_BYTES)
        self.drain_rate = DrainRate(drain_bytes_s, max(DRAIN_BURST_BYTES, drain_bytes_s / 16))
        self.paused = 0  # reads put off for the drain rate
        self._kept: dict[socket.socket, Callable[[], None]] = {}  # insertion order: oldest first

    @property
    def count(self) -> int:
        return len(self._kept)

    def adopt(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body_unfinished: bool = False,
              cut: bool = False, quiet: bool = False) -> bool:
        """Called from ``connection_lost`` of a connection closed without a reset: True when
        the socket lingers now (the caller does nothing more with it): it had unread bytes, or
        its request's body was still to come (on a busy machine the answer can be out before
        the client's first body bytes are). ``cut``: the edge cut it, it lingers briefly.
        ``quiet``: it made room for a newcomer; a silent one goes after CUT_IDLE_S (a flood of
        silent connections must not hold descriptors), one still sending is read as long as
        any other."""
        try:
            fd = sock.fileno()
        except (OSError, ValueError):
            return False
        if fd < 0 or self.limit <= 0 or not (body_unfinished or unread_bytes(fd) > 0):
            return False
        if self._kept and len(self._kept) >= self.limit:
            self.cut_short += 1
            self._kept[next(iter(self._kept))]()
        try:
            kept = socket.socket(fileno=os.dup(fd))
            kept.setblocking(False)
            kept.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        state = {"last": loop.time(), "timer": None, "resume": None, "booked": 0}
        started = loop.time()
        idle_s, total_s = (min(self.idle_s, CUT_IDLE_S), min(self.total_s, CUT_TOTAL_S)) if cut else \
            (min(self.idle_s, CUT_IDLE_S), self.total_s) if quiet else (self.idle_s, self.total_s)
        view = memoryview(self._buffer)

        def done() -> None:
            nonlocal readable, resume, check, pause
            if self._kept.pop(kept, None) is None:
                return  # already done
            loop.remove_reader(kept.fileno())
            for handle in (state["timer"], state["resume"]):
                if handle is not None:
                    handle.cancel()
            kept.close()
            if state["booked"]:  # what it booked and will not read goes back
                self.drain_rate.spend(-state["booked"], loop.time())
            # these closures refer to each other: freed now rather than by a full collection
            readable = resume = check = pause = None  # type: ignore[assignment]

        def resume() -> None:
            state["resume"] = None
            if kept in self._kept:
                state["last"] = loop.time()  # the pause was ours, not the client's silence
                loop.add_reader(kept.fileno(), readable)

        def pause(wait: float) -> None:
            self.paused += 1
            loop.remove_reader(kept.fileno())
            state["resume"] = loop.call_later(wait, resume)

        def readable() -> None:
            # The rate is asked before a read, not only after it: 200 refused 30 MB uploads,
            # all readable in one turn of the loop, each drained its 1 MiB in that turn (200 MiB,
            # 20 ms of the kernel's work between two probes). With nothing to spend, a read's
            # worth (what it holds, at most READ_BYTES) is booked and the read waits for it: each
            # one booked puts the next further off, so the waiting sockets come back one by one,
            # not all at once.
            now = loop.time()
            booked = state["booked"]
            if not booked and self.drain_rate.due(now) > 0:
                state["booked"] = max(1, min(READ_BYTES, unread_bytes(kept.fileno())))
                pause(self.drain_rate.spend(state["booked"], now))
                return
            try:
                n = kept.recv_into(view, len(view), DISCARD)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                done()
                return
            if n == 0:  # the client closed its side: its answer was read or will be
                done()
                return
            state["booked"] = 0
            self.drained_bytes += n
            state["last"] = now = loop.time()
            wait = self.drain_rate.spend(n - booked, now)
            if wait > 0:
                pause(wait)

        def check() -> None:
            now = loop.time()
            idle = state["resume"] is None and now - state["last"] >= idle_s
            if idle or now - started >= total_s:
                done()
                return
            state["timer"] = loop.call_later(min(1.0, idle_s / 2), check)

        self._kept[kept] = done
        loop.add_reader(kept.fileno(), readable)
        state["timer"] = loop.call_later(min(1.0, idle_s / 2), check)
        return True

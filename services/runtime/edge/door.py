"""The service port's door: its connections are accepted here and looked at before asyncio
makes a task, a transport and a guarded protocol of them.

Accepted by asyncio's server, every connection cost the loop those three (about 300 us)
whatever had become of it: 32 clients that each sent a request and hung up without reading
(5 500 connections a second, reset or closed) kept the jobs /healthz p99 at 166-186 ms
(detect 218 ms) and left 140-225 MiB behind; each probe waited behind connections whose
clients had already left, and every connection accepted in a turn was set up in the next
(a turn of 1 024 set-ups: 200 ms). Here, as each one is accepted (up to the backlog in a
turn, as asyncio does):
- one its client has reset, or closed without sending a byte, is closed there;
- a whole ``GET /healthz`` is answered there (the route's own answer, health_at_the_door),
  ahead of the connections accepted with it;
- a whole request whose client has already closed its side is closed there too: its
  client left before it was taken (nginx answers 499 to a client that closes before its
  answer); half a request whose client closed its side is set up after the rest, for its
  400 (CLOSED_PER_TURN a turn, the oldest dropped past CLOSED_QUEUE);
- the others queue for asyncio (connect_accepted_socket), SETUPS_PER_TURN a turn; with
  MAX_WAITING of them queued, accepting stops until the queue goes down (the rest wait in
  the kernel's queue for the room's decision, as before: its overflow, its probe reserve).
  A queued one is looked at again before it is set up: its client may have left meanwhile.
The listeners are also looked at between the callbacks of a long turn (look, turn_lane), so a
probe does not wait for the whole turn.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from common.accepting import RETRY_S, accept_one, pause
from common.http1 import whole_request
from common.socket_queues import TCP_CLOSE, TCP_CLOSE_WAIT, peek, tcp_state

log = logging.getLogger("onecard.edge")

MAX_PEEK = 16 * 1024       # a probe's whole request is far smaller
WARN_EVERY_S = 10.0        # out of descriptors: said at most this often
# accepted in one turn, as asyncio does (its backlog): 64 left the probes behind a longer
# kernel queue (32 clients sending and resetting: jobs p99 26 ms against 11)
ACCEPT_BATCH = 1024
SETUPS_PER_TURN = 16       # each about 200 us of the loop: a turn of them stays short
LOOKS_PER_TURN = 128       # queued ones looked at again in a turn (a few us each), those set up included
MAX_WAITING = 512          # accepted and waiting to be set up; beyond, newcomers wait in the kernel's queue
CLOSED_QUEUE = 64          # half requests whose client closed its side, waiting to be set up (for their 400)
CLOSED_PER_TURN = 4        # of those, set up in a turn with no other waiting
LOOK_BATCH = 64            # accepted at one look between a turn's callbacks (turn_lane), each 2 ms at most


class Door:
    """Accepting for the listening sockets of asyncio servers (uvicorn's), in their place."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stats: Any,
                 probe_answer: Callable[[bytes], bytes | None] | None, max_waiting: int = MAX_WAITING,
                 batch: int = ACCEPT_BATCH):
        self.loop, self.stats, self.probe_answer, self.batch = loop, stats, probe_answer, batch
        self.max_waiting = max_waiting
        self._warned_at = float("-inf")
        self._waiting: deque[tuple[socket.socket, Callable]] = deque()
        self._closed: deque[tuple[socket.socket, Callable]] = deque()  # their clients closed their side
        self._draining = False
        self._setups: set[asyncio.Task] = set()
        self._listeners: dict[int, tuple[socket.socket, Callable]] = {}  # by descriptor, with their factory
        self._poll = select.poll()  # the listeners, for looking between a long turn's callbacks (turn_lane)
        self._paused: set[int] = set()  # out of descriptors: until their one resume timer has run

    def open(self, servers: list[asyncio.AbstractServer]) -> bool:
        """Take over accepting from `servers`; False (asyncio keeps it) where a server does not
        say how it makes its protocols."""
        factories = [getattr(server, "_protocol_factory", None) for server in servers]
        if not servers or None in factories:
            return False
        for server, factory in zip(servers, factories, strict=True):
            for bound in server.sockets:
                listener = bound.dup()  # the same socket: asyncio's reader comes off it, this one goes on
                listener.setblocking(False)
                self.loop.remove_reader(bound.fileno())
                self._listeners[listener.fileno()] = (listener, factory)
                self.loop.add_reader(listener.fileno(), self._accept, listener, factory)
                self._poll.register(listener.fileno(), select.POLLIN)
        return True

    def look(self) -> None:
        """Connections waiting on the listeners taken now (TurnLane calls this between the
        callbacks of a long turn), LOOK_BATCH at most, but for a listener whose accepting is
        paused. Only accepted here: their set-ups stay SETUPS_PER_TURN a turn, from the queue."""
        if not self._listeners:
            return
        for fd, _ in self._poll.poll(0):
            taken = self._listeners.get(fd)
            if taken is not None and fd not in self._paused:
                self._accept(*taken, batch=LOOK_BATCH, drain=False)
        if self.queued and not self._draining:
            self._draining = True
            self.loop.call_soon(self._drain)

    def close(self) -> None:
        """Accept no more (the servers close their own sockets); those not set up yet are closed."""
        for fd, (listener, _) in self._listeners.items():
            self.loop.remove_reader(fd)
            self._poll.unregister(fd)
            listener.close()
        self._listeners.clear()
        for queue in (self._waiting, self._closed):
            while queue:
                queue.popleft()[0].close()

    @property
    def queued(self) -> int:
        return len(self._waiting) + len(self._closed)

    def _accept(self, listener: socket.socket, factory: Callable[[], asyncio.Protocol], batch: int | None = None,
                drain: bool = True) -> None:
        for _ in range(self.batch if batch is None else batch):
            if len(self._waiting) >= self.max_waiting:
                break  # the rest wait in the kernel's queue, for the room to decide on (its overflow,
                #        its probe reserve, its paced refusals), as they did before the door
            try:
                conn = accept_one(listener)
            except OSError as exc:
                if self.loop.time() - self._warned_at >= WARN_EVERY_S:
                    self._warned_at = self.loop.time()
                    log.warning("service port: cannot accept (%s); accepting again in %.1f s", exc, RETRY_S)
                fd = listener.fileno()
                self._paused.add(fd)
                pause(self.loop, listener, self._accept, listener, factory,
                      resumed=lambda fd=fd: self._paused.discard(fd))
                break
            if conn is None:
                break
            self._take(conn, factory)
        if drain and self.queued and not self._draining:
            self._drain()

    def _take(self, conn: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        head = peek(conn, MAX_PEEK)
        state = tcp_state(conn)
        if state == TCP_CLOSE_WAIT and not head:
            head = peek(conn, MAX_PEEK) or b""  # a byte may have come with the FIN
        if head == b"" or state == TCP_CLOSE:  # reset (its answer could never be read), or nothing to answer
            self._drop(conn)
            return
        whole = bool(head) and whole_request(head)
        if whole and self.probe_answer is not None and self._answer(conn, head):
            return
        if whole and state == TCP_CLOSE_WAIT:
            # its client left before it was taken (as nginx, which answers 499 to a client that
            # closes before its answer): 16 clients sending and closing at once had the app run
            # for each, and kept detect's /healthz p99 at 126 ms
            self._drop(conn)
            return
        if state == TCP_CLOSE_WAIT:
            self._closed.append((conn, factory))
            if len(self._closed) > CLOSED_QUEUE:
                self._drop(self._closed.popleft()[0])
        else:
            self._waiting.append((conn, factory))

    def _drain(self) -> None:
        """SETUPS_PER_TURN of the queued connections set up; the rest in the next turn. Each is
        looked at again first: one that waited may have been left by its client meanwhile."""
        self._draining = False
        n = looked = 0
        while n < SETUPS_PER_TURN and looked < LOOKS_PER_TURN:
            queue = self._waiting or (self._closed if n < CLOSED_PER_TURN else None)
            if not queue:
                break
            conn, factory = queue.popleft()
            looked += 1
            if queue is self._waiting and self._left(conn):
                self._drop(conn)
                continue
            n += 1
            task = self.loop.create_task(self._set_up(conn, factory))
            self._setups.add(task)
            task.add_done_callback(self._setups.discard)
        if self.queued:
            self._draining = True
            self.loop.call_soon(self._drain)

    @staticmethod
    def _left(conn: socket.socket) -> bool:
        """Reset, or closed after a whole request, while it waited (as _take decides)."""
        state = tcp_state(conn)
        if state == TCP_CLOSE:
            return True
        return state == TCP_CLOSE_WAIT and whole_request(peek(conn, MAX_PEEK) or b"")

    def _answer(self, conn: socket.socket, head: bytes) -> bool:
        answer = self.probe_answer(head)
        if answer is None:
            return False
        try:
            conn.recv(len(head))  # taken off the socket: a close with unread bytes is a reset
            conn.send(answer)     # a fresh socket's buffer takes a few hundred bytes at once
            self.stats.probes_at_accept += 1
        except OSError:
            pass
        conn.close()
        return True

    def _drop(self, conn: socket.socket) -> None:
        self.stats.gone_at_accept += 1
        conn.close()

    async def _set_up(self, conn: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        try:
            await self.loop.connect_accepted_socket(factory, conn)
        except OSError:  # reset between the look and the transport
            conn.close()
        except BaseException:  # a protocol that would not start: its socket is not left to the collector
            conn.close()
            raise

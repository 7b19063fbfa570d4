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
- the others queue for asyncio (connect_accepted_socket), SETUPS_PER_TURN a turn: those
  whose client has closed its side (it may still read its answer, or the 400 for half a
  request) after the rest, and the oldest of them closed past CLOSED_QUEUE; past max_connections
  waiting, a newcomer gets its 503 at once (the room would refuse it anyway).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from common.http1 import whole_request
from common.socket_queues import TCP_CLOSE, TCP_CLOSE_WAIT, tcp_state

log = logging.getLogger("onecard.edge")

MAX_PEEK = 16 * 1024       # a probe's whole request is far smaller
ACCEPT_RETRY_S = 0.1       # out of descriptors or buffers: accepting pauses this long (asyncio: 1 s)
OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# accepted in one turn, as asyncio does (its backlog): 64 left the probes behind a longer
# kernel queue (32 clients sending and resetting: jobs p99 26 ms against 11)
ACCEPT_BATCH = 1024
SETUPS_PER_TURN = 16       # each about 200 us of the loop: a turn of them stays short
CLOSED_QUEUE = 256         # whole requests whose client closed its side, waiting to be set up


def _peek(conn: socket.socket) -> bytes | None:
    """What waits on a new connection, left there; None when nothing yet, b"" when its client
    closed or reset it."""
    try:
        return conn.recv(MAX_PEEK, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


class Door:
    """Accepting for the listening sockets of asyncio servers (uvicorn's), in their place."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stats: Any,
                 probe_answer: Callable[[bytes], bytes | None] | None, refusal: bytes, max_waiting: int,
                 batch: int = ACCEPT_BATCH):
        self.loop, self.stats, self.probe_answer, self.batch = loop, stats, probe_answer, batch
        self.refusal, self.max_waiting = refusal, max_waiting
        self._listeners: list[socket.socket] = []
        self._waiting: deque[tuple[socket.socket, Callable]] = deque()
        self._closed: deque[tuple[socket.socket, Callable]] = deque()  # their clients closed their side
        self._draining = False
        self._setups: set[asyncio.Task] = set()

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
                self._listeners.append(listener)
                self.loop.add_reader(listener.fileno(), self._accept, listener, factory)
        return True

    def close(self) -> None:
        """Accept no more (the servers close their own sockets); those not set up yet are closed."""
        for listener in self._listeners:
            self.loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners = []
        for queue in (self._waiting, self._closed):
            while queue:
                queue.popleft()[0].close()

    @property
    def queued(self) -> int:
        return len(self._waiting) + len(self._closed)

    def _accept(self, listener: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        for _ in range(self.batch):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in OUT_OF_RESOURCES:
                    # the listener stays readable: asked again at once, the loop would spin on it
                    log.warning("service port: cannot accept (%s); accepting again in %.1f s", exc, ACCEPT_RETRY_S)
                    self.loop.remove_reader(listener.fileno())
                    self.loop.call_later(ACCEPT_RETRY_S, self._resume, listener, factory)
                break  # else (a connection aborted before it was taken): the next one, next turn
            self._take(conn, factory)
        if self.queued and not self._draining:
            self._drain()

    def _resume(self, listener: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        if listener in self._listeners:  # not closed meanwhile
            self.loop.add_reader(listener.fileno(), self._accept, listener, factory)

    def _take(self, conn: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        conn.setblocking(False)
        head = _peek(conn)
        state = tcp_state(conn)
        if state == TCP_CLOSE_WAIT and not head:
            head = _peek(conn) or b""  # a byte may have come with the FIN
        if head == b"" or state == TCP_CLOSE:  # reset (its answer could never be read), or nothing to answer
            self.stats.gone_at_accept += 1
            conn.close()
            return
        if head and self.probe_answer is not None and whole_request(head) and self._answer(conn, head):
            return
        if state == TCP_CLOSE_WAIT:
            self._closed.append((conn, factory))
            if len(self._closed) > CLOSED_QUEUE:
                self.stats.gone_at_accept += 1
                self._closed.popleft()[0].close()
        elif len(self._waiting) >= self.max_waiting:
            self.stats.refused += 1
            self._send_and_close(conn, self.refusal)
        else:
            self._waiting.append((conn, factory))

    def _drain(self) -> None:
        """SETUPS_PER_TURN of the queued connections set up; the rest in the next turn."""
        self._draining = False
        for _ in range(SETUPS_PER_TURN):
            queue = self._waiting or self._closed
            if not queue:
                return
            conn, factory = queue.popleft()
            task = self.loop.create_task(self._set_up(conn, factory))
            self._setups.add(task)
            task.add_done_callback(self._setups.discard)
        if self.queued:
            self._draining = True
            self.loop.call_soon(self._drain)

    def _answer(self, conn: socket.socket, head: bytes) -> bool:
        answer = self.probe_answer(head)
        if answer is None:
            return False
        try:
            conn.recv(len(head))  # taken off the socket: a close with unread bytes is a reset
        except OSError:
            conn.close()
            return True
        self.stats.probes_at_accept += 1
        self._send_and_close(conn, answer)
        return True

    @staticmethod
    def _send_and_close(conn: socket.socket, data: bytes) -> None:
        try:
            conn.send(data)  # a fresh socket's buffer takes a few hundred bytes at once
        except OSError:
            pass
        conn.close()

    async def _set_up(self, conn: socket.socket, factory: Callable[[], asyncio.Protocol]) -> None:
        try:
            await self.loop.connect_accepted_socket(factory, conn)
        except OSError:  # reset between the look and the transport
            conn.close()

"""The probe port: a tiny HTTP/1.1 server for orchestrator probes (/healthz, /readyz,
/metrics) and nothing else.

It is what the network reaches, so it must answer a kubelet at once whatever other clients
do: a bounded number of connections (`health_max_clients`) where idle ones make room for
newcomers (connection_slots.py), a deadline for the whole request head
(`health_idle_timeout_s`, never reset by a trickle of bytes), a head of at most 8 KiB (431
past it), and every error in the JSON envelope ``{"error": {"code": ..., "message": ...}}``
(the HTTP pieces: common/http1.py). By default it listens on
every interface, IPv4 and IPv6, so that the orchestrator reaches it on the pod's IP
whatever family the cluster uses.

Connections are accepted here, not by asyncio's server: each one it accepts costs a task,
a transport and a stream pair (about 250 us of the loop), and 24 threads that only connected
and closed, 2 000 a second, kept the listen queue full, so that a probe's connection waited
a second in it or was dropped (7 of 72 probes failed). A connection is looked at when it is
accepted: one its client already closed without a byte is closed at once, one whose whole
request is there (a probe's, sent with its connect) is answered at once, in the same turn,
and only the rest (silent so far, or a request still coming) is handed to a stream and a slot.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

from common import http1
from common.accepting import accept_one, pause
from common.socket_queues import peek, peer_closed
from supervisor.config.settings import SupervisorSettings
from supervisor.servers import connection_slots
from supervisor.servers.connection_slots import ClosableServer, Slots

BACKLOG = 1024
# connections accepted in one turn of the loop: those with a whole request are answered in it,
# so the turn stays short (a flood of /metrics requests must not hold the loop)
ACCEPT_BATCH = 64
ALL_INTERFACES = ("", "*")
ALLOW = (("Allow", "GET, HEAD"),)

Route = Callable[[], http1.Answer]


# Answered the moment they are accepted: the probes, whose answers cost nothing to make. A
# /metrics answer is rendered: answered at accept, 32 clients asking in a loop got 6 800 a
# second and the supervisor's CPU took the services' from them (their /healthz p99 20-35 ms);
# through a stream and a slot, as before, 3 250 a second and 6-11 ms.
AT_ONCE = tuple(f"{method} {path} ".encode() for method in ("GET", "HEAD") for path in ("/healthz", "/readyz"))


def _probe_at_once(head: bytes) -> bool:
    return head.startswith(AT_ONCE) and len(head) <= http1.MAX_HEAD and http1.whole_request(head)


class ProbePortError(Exception):
    """The probe port cannot be opened; `taken` when another process holds it."""

    def __init__(self, message: str, taken: bool = False):
        super().__init__(message)
        self.taken = taken


class ProbePortServer(ClosableServer):
    """``routes`` maps a path to a function returning its answer; its address and limits are
    the ``health_*`` settings (a new limit is a key there and its use here)."""

    def __init__(self, settings: SupervisorSettings, routes: dict[str, Route],
                 on_refused: Callable[[int], None] = lambda n: None):
        self.host, self.port, self.routes = settings.health_host, settings.health_port, routes
        self.on_refused = on_refused
        self.idle_timeout_s = settings.health_idle_timeout_s
        self.slots = Slots(settings.health_max_clients)
        self._server: asyncio.AbstractServer | None = None
        self._listeners: list[socket.socket] = []
        self._streams: set[asyncio.Task] = set()
        self.answered_at_accept = 0   # probes answered the moment they were accepted
        self.gone_at_accept = 0       # closed by their client before a whole request

    @property
    def max_clients(self) -> int:
        return self.slots.limit

    @property
    def refused(self) -> int:
        return self.slots.closed_early

    def where(self) -> str:
        return f"every interface, port {self.port}" if self.host in ALL_INTERFACES else f"{self.host}:{self.port}"

    async def start(self) -> None:
        host = None if self.host in ALL_INTERFACES else self.host
        try:
            # bound here, served by _accept (start_serving=False: asyncio neither listens nor accepts)
            self._server = await asyncio.start_server(self._handle, host, self.port, reuse_address=True,
                                                      limit=http1.MAX_HEAD, backlog=BACKLOG,
                                                      start_serving=False)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                from supervisor.system.ports import port_holder
                holder = await asyncio.to_thread(port_holder, self.port)
                raise ProbePortError(f"supervisor.health_port: port {self.port} on {self.where()} is taken"
                                     + (f" by {holder}" if holder else ""), taken=True) from None
            if host is None:  # no IPv6 here: IPv4 alone is every interface there is
                self.host = "0.0.0.0"
                return await self.start()
            raise ProbePortError(f"cannot listen on {self.where()} for probes: {exc}") from None
        loop = asyncio.get_running_loop()
        for bound in self._server.sockets:
            listener = bound.dup()  # the same socket: closing the server closes it too, with this
            listener.setblocking(False)
            listener.listen(BACKLOG)
            self._listeners.append(listener)
            loop.add_reader(listener.fileno(), self._accept, listener)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for listener in self._listeners:
            loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners = []
        await super().close()

    # ---- accepting ----------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn = accept_one(listener)
            except OSError:
                pause(asyncio.get_running_loop(), listener, self._accept, listener)
                return
            if conn is None:
                return
            self._take(conn)

    def _take(self, conn: socket.socket) -> None:
        head = peek(conn, connection_slots.MAX_PEEK)
        if head and not _probe_at_once(head) and peer_closed(conn):
            # its client has closed: the rest may have come with the FIN (a whole request still
            # gets its answer); a half one can never be whole, and the stream would not answer it
            head = peek(conn, connection_slots.MAX_PEEK) or b""
            if not http1.whole_request(head):
                head = b""
        if head is not None and _probe_at_once(head):
            self._answer_at_once(conn, head)
        elif head == b"":  # its client left without a byte, or with half a request
            self.gone_at_accept += 1
            conn.close()
        else:
            self._spawn(self._stream(conn))

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)

    def _answer_at_once(self, conn: socket.socket, head: bytes) -> None:
        self.answered_at_accept += 1
        answer, method = self._respond(head)
        data = http1.encode_answer(answer, head_only=method == "HEAD")
        try:
            conn.recv(len(head))  # taken off the socket: a close with unread bytes is a reset
            sent = conn.send(data)
        except OSError:
            conn.close()
            return
        if sent == len(data):
            conn.close()
        else:
            self._spawn(self._send_rest(conn, data[sent:]))

    async def _send_rest(self, conn: socket.socket, rest: bytes) -> None:
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(conn, rest), self.idle_timeout_s)
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()

    async def _stream(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=http1.MAX_HEAD)
        except OSError:
            conn.close()
            return
        await self._handle(reader, writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        before = self.refused
        buffered = lambda: bytes(getattr(reader, "_buffer", b"")[:connection_slots.MAX_PEEK])  # noqa: E731
        head = None
        if not self.slots.admit(writer, buffered):
            head = await self.slots.admit_late(
                writer, lambda: http1.read_head(reader, timeout_s=connection_slots.LATE_S))
            if head is None:
                self.on_refused(self.refused)
                writer.transport.abort()
                return
        if self.refused != before:  # an idle one made room
            self.on_refused(self.refused)
        try:
            answer, method = await self._answer(reader, writer, head)
            if answer is not None:
                await http1.send_answer(writer, answer, timeout_s=self.idle_timeout_s, head_only=method == "HEAD")
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            self.slots.leave(writer)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      head: bytes | None) -> tuple[http1.Answer | None, str]:
        """The answer and the request's method; no answer for a client that sent nothing.
        ``head``: the request head when it was read already (a newcomer taken late)."""
        try:
            if head is None:
                head = await http1.read_head(reader, timeout_s=self.idle_timeout_s,
                                             on_first_bytes=lambda: self.slots.started(writer))
        except http1.HeadTooLarge:
            return http1.error_answer(431, "headers_too_large",
                                      f"the request head is over {http1.MAX_HEAD} bytes"), "GET"
        except http1.HeadTimeout as exc:
            if exc.started:  # a started request: say why it ends (an idle connection just closes)
                return http1.error_answer(408, "request_timeout",
                                          f"no complete request within {self.idle_timeout_s:g} s"), "GET"
            return None, ""
        except asyncio.IncompleteReadError:
            return None, ""
        self.slots.working(writer)
        return self._respond(head)

    def _respond(self, head: bytes) -> tuple[http1.Answer, str]:
        """The answer to a whole request head, and its method."""
        try:
            request = http1.parse_request_line(head)
        except http1.BadRequestLine as exc:
            return http1.error_answer(400, "bad_request", str(exc)), "GET"
        method = request.method
        if method not in ("GET", "HEAD"):
            return http1.error_answer(405, "method_not_allowed", f"{method[:16]} is not allowed here; use GET or HEAD",
                                      ALLOW), "GET"
        route = self.routes.get(request.path)
        if route is None:
            known = ", ".join(sorted(self.routes))
            return http1.error_answer(404, "not_found", f"this port answers only {known}"), method
        return route(), method

"""Paused uploads resume reading a few per turn of the event loop, first come first served
(services.runtime.edge.read_turns); the real sockets are in tests/integration/test_limits.py."""

from __future__ import annotations

import asyncio

from services.runtime.edge.connection_limits import ConnectionStats
from services.runtime.edge.read_turns import ReadTurns, TurnedFlowControl


class Transport:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.closing = name, log, False

    def pause_reading(self):
        self.log.append(("pause", self.name))

    def resume_reading(self):
        self.log.append(("resume", self.name))

    def is_closing(self):
        return self.closing


def _resumed(log: list) -> list[str]:
    return [name for what, name in log if what == "resume"]


def test_a_few_resume_per_turn_the_rest_in_order_in_the_turns_after():
    class Stats(ConnectionStats):
        pass

    async def main():
        loop = asyncio.get_running_loop()
        turns, log = ReadTurns(Stats, per_turn=3), []
        flows = [TurnedFlowControl(Transport(str(i), log), turns, loop) for i in range(8)]
        for flow in flows:
            flow.pause_reading()
        for flow in flows:
            flow.resume_reading()
            flow.resume_reading()   # asked twice: still one turn
        seen = [_resumed(log)]
        for _ in range(4):
            await asyncio.sleep(0)
            seen.append(_resumed(log))
        return seen, flows

    seen, flows = asyncio.run(main())
    assert seen[0] == ["0", "1", "2"]
    assert seen[1] == ["0", "1", "2", "3", "4", "5"]
    assert seen[2] == seen[3] == [str(i) for i in range(8)]
    assert not any(flow.read_paused for flow in flows)
    assert Stats.reads_deferred == 5


def test_a_pause_or_a_close_takes_back_a_resume_still_waiting():
    async def main():
        loop = asyncio.get_running_loop()
        turns, log = ReadTurns(per_turn=1), []
        first, paused_again, closed, last = (TurnedFlowControl(Transport(n, log), turns, loop)
                                             for n in ("first", "paused", "closed", "last"))
        for flow in (first, paused_again, closed, last):
            flow.pause_reading()
            flow.resume_reading()
        paused_again.pause_reading()
        closed._transport.closing = True
        for _ in range(3):
            await asyncio.sleep(0)
        return log, paused_again, closed

    log, paused_again, closed = asyncio.run(main())
    assert _resumed(log) == ["first", "last"]   # the ones taken back did not use up a turn
    assert paused_again.read_paused and closed.read_paused


def test_with_nothing_waiting_no_turn_is_kept_armed():
    async def main():
        loop = asyncio.get_running_loop()
        turns, log = ReadTurns(per_turn=2), []
        flow = TurnedFlowControl(Transport("a", log), turns, loop)
        flow.pause_reading()
        flow.resume_reading()
        for _ in range(3):
            await asyncio.sleep(0)
        return turns, loop, log

    turns, loop, log = asyncio.run(main())
    assert _resumed(log) == ["a"] and not turns._armed


def test_a_small_request_sent_with_the_connect_is_read_as_the_connection_is_made():
    """A probe's request is read in connection_made (two turns fewer), on real sockets; an
    upload's first piece is left to the reader, so that a burst of accepted uploads is not
    all read in one turn."""
    import socket

    from services.runtime.edge.read_turns import READ_AT_ONCE_BYTES, read_at_once

    async def main():
        loop = asyncio.get_running_loop()
        events: dict[int, list] = {}

        class Recorder(asyncio.Protocol):
            def connection_made(self, transport):
                self.log = events.setdefault(transport.get_extra_info("peername")[1], [])
                self.log.append("made")
                self.log.append(("read at once", read_at_once(transport)))
                self.log.append("made done")

            def data_received(self, data):
                self.log.append(("data", len(data)))

        server = await loop.create_server(Recorder, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        probe = socket.create_connection(("127.0.0.1", port))   # connected by the kernel; not accepted yet
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        upload = socket.create_connection(("127.0.0.1", port))
        upload.sendall(b"x" * (READ_AT_ONCE_BYTES + 1))
        silent = socket.create_connection(("127.0.0.1", port))
        try:
            for _ in range(100):
                await asyncio.sleep(0.02)
                if len(events) == 3 and all(len(log) > 3 for p, log in events.items()
                                            if p != silent.getsockname()[1]):
                    break
            small = events[probe.getsockname()[1]]
            assert small[:4] == ["made", ("data", 34), ("read at once", True), "made done"], small
            big = events[upload.getsockname()[1]]
            assert big[:3] == ["made", ("read at once", False), "made done"] and big[3][0] == "data", big
            assert events[silent.getsockname()[1]] == ["made", ("read at once", False), "made done"]
        finally:
            for s in (probe, upload, silent):
                s.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_the_guarded_protocol_answers_a_probe_sent_with_its_connect_in_three_turns():
    """uvicorn's protocol with the edge's limits (services.runtime.edge.protocol), in this
    process on a real socket: its request is read as the connection is made. Left to the
    reader, it took a turn more; in a turn of a busy service every upload in flight moves a
    piece, so each turn a probe waits costs it milliseconds."""
    import socket

    import uvicorn
    from uvicorn.server import ServerState

    from services.runtime.edge.connection_limits import ConnectionLimits
    from services.runtime.edge.protocol import guarded_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        loop = asyncio.get_running_loop()
        protocol = guarded_protocol(ConnectionLimits(max_connections=8))
        config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning")
        config.load()
        state = ServerState()
        server = await loop.create_server(lambda: protocol(config=config, server_state=state, app_state={}),
                                          "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        turns = [0]

        def count():
            turns[0] += 1
            loop.call_soon(count)

        client = socket.create_connection(("127.0.0.1", port))
        try:
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # with the connect, before the accept
            client.setblocking(False)
            loop.call_soon(count)
            got = b""
            while not got.endswith(b"ok") and turns[0] < 200:
                await asyncio.sleep(0)
                try:
                    got += client.recv(4096)
                except BlockingIOError:
                    pass
            assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok"), got
            assert turns[0] <= 5, turns[0]   # read in connection_made; a turn more when left to the reader
        finally:
            client.close()
            for conn in list(state.connections):
                conn.shutdown()
            server.close()
            await server.wait_closed()

    asyncio.run(main())

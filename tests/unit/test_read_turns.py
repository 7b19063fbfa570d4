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

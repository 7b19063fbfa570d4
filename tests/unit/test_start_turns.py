"""Requests start their app a few per turn of the loop; a probe at once (start_turns)."""

from __future__ import annotations

import asyncio

from services.runtime.edge.start_turns import PendingStart, StartTurns, is_probe


def one_turn(loop: asyncio.AbstractEventLoop) -> None:
    loop.call_soon(loop.stop)  # run_forever then runs what is ready once, and returns
    loop.run_forever()


def test_a_few_requests_start_per_turn_first_come_first_served_and_a_probe_at_once():
    loop = asyncio.new_event_loop()
    try:
        turns, started = StartTurns(per_turn=4), []
        for i in range(10):  # ten requests read in one turn
            turns.start(lambda i=i: started.append(i), loop)
        turns.start(lambda: started.append("probe"), loop, prompt=True)
        assert started == [0, 1, 2, 3, "probe"] and turns.waiting == 6 and turns.deferred == 6
        one_turn(loop)
        assert started[5:] == [4, 5, 6, 7]
        turns.start(lambda: started.append("late"), loop)  # behind those still waiting
        one_turn(loop)
        assert started[9:] == [8, 9, "late"] and turns.waiting == 0
        one_turn(loop)
        turns.start(lambda: started.append("next"), loop)  # a quiet turn: at once
        assert started[-1] == "next"
    finally:
        loop.close()


def test_only_a_get_of_a_probes_path_is_prompt():
    assert is_probe({"method": "GET", "path": "/healthz"}) and is_probe({"method": "GET", "path": "/readyz"})
    assert not is_probe({"method": "POST", "path": "/healthz"})
    assert not is_probe({"method": "GET", "path": "/v1/jobs/x"})


class _Cycle:
    def __init__(self, disconnected: bool = False):
        self.disconnected = disconnected


def test_a_start_let_go_or_whose_client_left_is_skipped_without_using_its_turns_room():
    loop = asyncio.new_event_loop()
    try:
        turns, started = StartTurns(per_turn=2), []
        run = lambda cycle, app: started.append(app)  # noqa: E731 - the protocol's own start
        pending = [PendingStart(run, _Cycle(), i) for i in range(8)]
        for p in pending:
            turns.start(p, loop)
        assert started == [0, 1] and turns.waiting == 6
        for p in pending[2:6]:
            p.let_go()  # their connections were lost
        pending[6]._cycle.disconnected = True
        one_turn(loop)
        assert started == [0, 1, 7] and turns.waiting == 0
        assert all(p._start is None and p._cycle is None and p._app is None for p in pending)  # nothing held
    finally:
        loop.close()

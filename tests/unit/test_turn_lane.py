"""The loop's ready queue that looks at the door's listeners between the callbacks of a long
turn (services.runtime.edge.turn_lane): when it looks, on a scripted clock, and how it is put
in place on asyncio's own loop."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from services.runtime.edge.turn_lane import TurnLane, install


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_it_looks_once_its_interval_has_passed_counted_from_the_end_of_the_last_look():
    clock, looks = Clock(), []

    def look() -> None:
        looks.append(clock.now)
        clock.now += 0.005  # a look that took longer than the interval
    lane = TurnLane(deque(range(10)), look, every_s=0.002, clock=clock)
    assert lane.popleft() == 0 and looks == []   # 0 ms: not yet
    clock.now = 0.0019
    assert lane.popleft() == 1 and looks == []
    clock.now = 0.002
    assert lane.popleft() == 2 and looks == [0.002]  # the look comes before the callback
    # the look ended at 7 ms: the callbacks run until 9 ms before the next one
    clock.now = 0.0085
    lane.popleft()
    assert looks == [0.002]
    clock.now = 0.0091
    lane.popleft()
    assert looks == [0.002, 0.0091]
    assert list(lane) == [5, 6, 7, 8, 9]  # nothing lost or reordered


def test_a_look_that_fails_is_logged_and_not_tried_again_and_the_callbacks_still_run(caplog):
    clock, calls = Clock(), [0]

    def look() -> None:
        calls[0] += 1
        raise RuntimeError("boom")
    lane = TurnLane(deque("abc"), look, every_s=0.001, clock=clock)
    clock.now = 1.0
    with caplog.at_level(logging.ERROR, "onecard.edge"):
        assert lane.popleft() == "a"
    clock.now = 100.0
    assert lane.popleft() == "b" and lane.popleft() == "c"
    assert calls[0] == 1 and "no longer done" in caplog.text


def test_installed_on_a_running_loop_the_pending_callbacks_keep_their_order():
    loop = asyncio.new_event_loop()
    try:
        ran: list[str] = []
        looks = [0]

        def look() -> None:
            looks[0] += 1

        def first() -> None:
            ran.append("first")
            assert install(loop, look, every_s=0.0)
            assert install(loop, look, every_s=0.0)  # twice: the same lane, not a lane in a lane
        loop.call_soon(first)
        for name in ("second", "third"):
            loop.call_soon(ran.append, name)
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert ran == ["first", "second", "third"]
        assert type(loop._ready) is TurnLane and looks[0] >= 3
        loop.call_soon(ran.append, "next turn")
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert ran[-1] == "next turn"
    finally:
        loop.close()


def test_a_loop_without_asyncio_s_ready_deque_is_left_as_it_is():
    class OtherLoop:
        _ready = [1, 2]
    other = OtherLoop()
    assert not install(other, lambda: None)
    assert other._ready == [1, 2]
    assert not install(object(), lambda: None)


def test_a_callback_handed_to_the_old_queue_while_it_is_replaced_is_moved_not_lost():
    """call_soon_threadsafe from another thread appends to whichever deque it found: one
    appended to the old queue just before the swap still runs."""
    class RacingLoop:
        def __init__(self):
            self.__dict__["_ready"] = deque(["first"])

        def __setattr__(self, name, value):
            if name == "_ready":  # another thread's append, just before the new queue is in place
                self.__dict__["_ready"].append("handed over meanwhile")
            self.__dict__[name] = value
    loop = RacingLoop()
    assert install(loop, lambda: None)
    assert type(loop._ready) is TurnLane and list(loop._ready) == ["first", "handed over meanwhile"]

"""QueueRoom: a submit that finds the queue full waits in line for room, first come first
served, for at most queue_wait_s; a job that could never fit is refused at once. The queue
here is a counter of free places; the integration test runs it against the real jobs service."""

from __future__ import annotations

import asyncio

import pytest

from services.jobs.broker import JobTooLarge, QueueFull
from services.jobs.queue_room import ClientGone, QueueRoom


class Places:
    def __init__(self, free: int):
        self.free = free
        self.taken: list[str] = []
        self.tries = 0

    def attempt(self, name: str):
        async def go() -> str:
            self.tries += 1
            if name.startswith("huge"):
                raise JobTooLarge("over the whole budget")
            if self.free <= 0:
                raise QueueFull("3 jobs are already waiting for m1")
            self.free -= 1
            self.taken.append(name)
            return name
        return go


async def _in_line(room: QueueRoom, places: Places, *names: str) -> list[asyncio.Task]:
    """Submits that find no room, each started after the one before has joined the line."""
    tasks = []
    for name in names:
        tasks.append(asyncio.create_task(room.submit(places.attempt(name))))
        await asyncio.sleep(0.01)
    return tasks


def test_room_now_is_taken_at_once():
    async def main():
        room, places = QueueRoom(5), Places(1)
        assert await room.submit(places.attempt("a")) == "a"
        assert (room.waited, room.refused, places.tries) == (0, 0, 1)
    asyncio.run(main())


def test_waiters_get_room_in_the_order_they_came_and_newcomers_go_behind_them():
    async def main():
        room, places = QueueRoom(5), Places(0)
        first, second = await _in_line(room, places, "first", "second")
        assert room.waiting == 2 and not first.done()
        places.free = 1  # room for one: the first in line takes it
        assert await first == "first"
        third = asyncio.create_task(room.submit(places.attempt("third")))
        await asyncio.sleep(0.01)
        places.free = 1  # the newcomer does not take it from the one that waited
        assert await second == "second"
        places.free = 1
        assert await third == "third"
        assert places.taken == ["first", "second", "third"]
        assert (room.waiting, room.waited, room.refused) == (0, 3, 0)
    asyncio.run(main())


def test_room_that_frees_between_two_tries_goes_to_the_waiter_not_to_a_newcomer():
    async def main():
        room, places = QueueRoom(5), Places(0)
        waiter = asyncio.create_task(room.submit(places.attempt("waiter")))
        await asyncio.sleep(0.2)  # it has tried a few times; it now pauses between tries
        places.free = 1
        newcomer = asyncio.create_task(room.submit(places.attempt("newcomer")))
        assert await waiter == "waiter"
        places.free = 1
        assert await newcomer == "newcomer"
        assert places.taken == ["waiter", "newcomer"]
    asyncio.run(main())


def test_a_submit_that_finds_no_room_in_time_is_queue_full_with_the_queues_reason():
    async def main():
        room, places = QueueRoom(0.2), Places(0)
        start = asyncio.get_running_loop().time()
        with pytest.raises(QueueFull) as err:
            await room.submit(places.attempt("late"))
        assert asyncio.get_running_loop().time() - start >= 0.2
        assert "3 jobs are already waiting" in str(err.value) and "queue_wait_s" in str(err.value)
        assert (room.waiting, room.refused) == (0, 1)
        assert places.tries >= 3  # it tried again while it waited
    asyncio.run(main())


def test_no_wait_is_queue_full_at_once_and_too_large_is_never_waited_for():
    async def main():
        with pytest.raises(QueueFull):
            await QueueRoom(0).submit(Places(0).attempt("now"))
        room = QueueRoom(5)
        start = asyncio.get_running_loop().time()
        with pytest.raises(JobTooLarge):
            await room.submit(Places(0).attempt("huge"))
        assert asyncio.get_running_loop().time() - start < 0.1 and room.waited == 0
    asyncio.run(main())


def test_a_waiter_that_leaves_hands_its_turn_on():
    async def main():
        room, places = QueueRoom(5), Places(0)
        first, second = await _in_line(room, places, "first", "second")
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        places.free = 1
        assert await asyncio.wait_for(second, 2) == "second"
        assert room.waiting == 0
    asyncio.run(main())


def test_a_waiter_whose_client_went_away_leaves_the_line_without_submitting():
    async def main():
        room, places = QueueRoom(5), Places(0)
        away = [False]

        async def gone() -> bool:
            return away[0]
        first = asyncio.create_task(room.submit(places.attempt("first"), gone))
        await asyncio.sleep(0.05)
        away[0] = True
        with pytest.raises(ClientGone):
            await asyncio.wait_for(first, 2)
        places.free = 1
        assert await room.submit(places.attempt("next")) == "next"
        assert places.taken == ["next"] and (room.left, room.waiting) == (1, 0)
    asyncio.run(main())

"""Who may call a local service now, and whether a call ran alone.

Normal calls run side by side. A solo call (a job that was in flight when its service
crashed, so that it may be the one that crashed it) waits until nothing else runs, then
runs alone while every other call waits; solo calls go one at a time, in order. Each call
learns whether another one overlapped it: a crash is charged to a job only when its call
ran alone, because with several in flight nobody can tell which one brought the service
down.
"""

from __future__ import annotations

import asyncio
import collections


class Ticket:
    __slots__ = ("solo", "overlapped")

    def __init__(self, solo: bool):
        self.solo = solo
        self.overlapped = False

    @property
    def alone(self) -> bool:
        return not self.overlapped


class CallGate:
    def __init__(self) -> None:
        self.active: set[Ticket] = set()
        self.solo_waiting: collections.deque[Ticket] = collections.deque()
        self._cond = asyncio.Condition()

    @property
    def isolating(self) -> bool:
        """A solo call waits or runs: nothing else starts."""
        return bool(self.solo_waiting) or any(t.solo for t in self.active)

    def _admit(self, ticket: Ticket) -> Ticket:
        if self.active:
            ticket.overlapped = True
            for other in self.active:
                other.overlapped = True
        self.active.add(ticket)
        return ticket

    async def enter(self, solo: bool = False) -> Ticket:
        ticket = Ticket(solo)
        async with self._cond:
            if not solo:
                await self._cond.wait_for(lambda: not self.isolating)
                return self._admit(ticket)
            self.solo_waiting.append(ticket)
            try:
                await self._cond.wait_for(lambda: self.solo_waiting[0] is ticket and not self.active)
            finally:
                self.solo_waiting.remove(ticket)  # admitted, or cancelled while waiting
                self._cond.notify_all()
            return self._admit(ticket)

    async def leave(self, ticket: Ticket) -> None:
        async with self._cond:
            self.active.discard(ticket)
            self._cond.notify_all()

    async def wait_clear(self) -> None:
        """Until no solo call waits or runs (the consumer takes no new job meanwhile)."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self.isolating)

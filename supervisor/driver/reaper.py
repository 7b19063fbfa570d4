"""Who waits for which pid. Every exit the OS layer reaps goes to exactly one owner: a
supervised child, a one-shot helper (the MPS control client), or nobody: an orphan that
was re-parented to us (as PID 1 or a child subreaper), counted and forgotten. Whoever
awaits a pid's exit (`wait_exit`) is told in every case.
"""

from __future__ import annotations

import asyncio
import collections

from supervisor.driver.child import ChildProcess
from supervisor.policy.child_lifecycle import ChildEvent


class Reaper:
    def __init__(self) -> None:
        self._children: dict[int, ChildProcess] = {}
        self._oneshots: dict[int, asyncio.Future] = {}
        self._waiters: dict[int, list[asyncio.Future]] = collections.defaultdict(list)
        self.orphans_reaped = 0
        self._recent_orphans: collections.deque[int] = collections.deque(maxlen=256)

    def adopt(self, child: ChildProcess, pid: int, now: float, *, detached: bool = False) -> bool:
        """`pid` is `child`'s main process from now on. A `detached` one (a daemon that
        re-parented to us by itself) may have died before we knew it was ours: then it was
        reaped as an orphan already, it is not registered, and False says so."""
        child.pid = pid
        child.started_at = now
        child.fire(ChildEvent.STARTED)
        if detached and pid in self._recent_orphans:
            return False
        self._children[pid] = child
        return True

    def expect_oneshot(self, pid: int) -> asyncio.Future:
        """A helper's exit code, when it is reaped (never taken for an orphan)."""
        exited = asyncio.get_running_loop().create_future()
        self._oneshots[pid] = exited
        return exited

    def oneshot_pids(self) -> set[int]:
        return set(self._oneshots)

    def wait_exit(self, pid: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[pid].append(fut)
        return fut

    def settle(self, pid: int, code: int) -> ChildProcess | None:
        """A reaped exit: its waiters told, a one-shot resolved; the supervised child whose
        main process it was, or None."""
        for fut in self._waiters.pop(pid, []):
            if not fut.done():
                fut.set_result(code)
        shot = self._oneshots.pop(pid, None)
        if shot is not None:
            if not shot.done():
                shot.set_result(code)
            return None
        child = self._children.pop(pid, None)
        if child is None:
            self.orphans_reaped += 1
            self._recent_orphans.append(pid)
        return child

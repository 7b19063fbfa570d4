"""What the services start, seen from the driver: their containment (system/containment.py), the
leftovers of an earlier run, the sentinel, and the last sweep before the unit exits.

A service counts as gone only when its main process is reaped *and* nothing it started is
left (lifecycle: LINGERING until EMPTIED). A stop sends SIGTERM to every process of a
service, not only to its process group (as systemd's KillMode=control-group does), and
SIGKILL to all of them after grace_s. The unit never exits 0 while a process it started is
alive. Every look at /proc or /sys runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.driver.child import ChildProcess
from supervisor.driver.events import Handlers
from supervisor.driver.port import DriverPort
from supervisor.policy.child_lifecycle import ChildEvent, ChildState
from supervisor.system.containment import Containment, Marker, new_run_id, unit_key

LINGER_CHECK_S = 0.1   # between looks at a lingering service (also woken by each SIGCHLD)
SWEEP_TERM_S = 1.0     # the last sweep's SIGTERM to SIGKILL wait
SWEEP_WAIT_S = 2.0     # then this long for SIGKILLed processes to vanish


@dataclass(frozen=True)
class ChildEmptied:
    """Nothing a reaped child started is left: it counts as gone."""
    child: ChildProcess


class Descendants:
    def __init__(self, port: DriverPort):
        self.port = port
        self.marker = Marker(unit_key(port.settings.control_socket), new_run_id())
        self.containment: Containment | None = None
        self.sentinel_pid: int | None = None
        self._sentinel_fd: int | None = None
        self._nudge: asyncio.Future | None = None
        self._watching = False
        self._prepared: asyncio.Future | None = None
        self.killed_left = 0   # processes SIGKILLed after their service's main process exited

    def handlers(self) -> Handlers:
        return {ChildEmptied: self._on_emptied}

    def _on_emptied(self, event: ChildEmptied) -> None:
        event.child.fire(ChildEvent.EMPTIED)

    def env(self) -> dict[str, str]:
        return self.marker.env()

    def join_path(self, child: ChildProcess) -> str | None:
        return self.containment.join_path(child.name) if self.containment is not None else None

    # ---- start ----------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Before any service: the containment, what an earlier run left, the sentinel.
        Shielded: a stop that comes meanwhile lets it finish (end() waits for it), so that
        no cgroup or sentinel appears after the last sweep."""
        self._prepared = asyncio.ensure_future(self._prepare())
        await asyncio.shield(self._prepared)

    async def _prepare(self) -> None:
        port = self.port
        names = [c.name for c in port.children]
        mode = port.settings.containment
        self.containment = await asyncio.to_thread(port.system.containment, self.marker, names, mode)
        how = self.containment.describe()
        if mode not in ("auto", self.containment.kind):
            port.log.warning(f"containment: {mode} was asked for but cannot be used here; using {how}")
        else:
            port.log.info(f"containment: {how}")
        found, dirs = await asyncio.to_thread(port.system.leftovers, self.marker)
        if found or dirs:
            listed = ", ".join(f"pid {x.pid} ({x.what}; {x.where})" for x in found[:8])
            more = f" and {len(found) - 8} more" if len(found) > 8 else ""
            port.log.warning(f"an earlier run of this unit (its supervisor gone) left {len(found)} process(es): "
                             f"{listed or 'none'}{more}; ending them (SIGKILL)")
            alive = await asyncio.to_thread(port.system.end_leftovers, self.marker, found, dirs)
            if alive:
                port.log.error(f"still alive after SIGKILL: {sorted(alive)}")
        try:
            self.sentinel_pid, self._sentinel_fd = port.system.start_sentinel(self.containment.spec())
        except OSError as exc:
            port.log.warning(f"containment: no sentinel ({exc}); if the supervisor is SIGKILLed, what the "
                            f"services started is ended at the next start instead")

    # ---- while stopping -------------------------------------------------------------------
    def signal_all(self, children: list[ChildProcess], sig: int) -> None:
        """Beside each process group (signalled by the driver): every other process of each
        started service, in a worker thread."""
        targets = [c for c in children if c.pid is not None and c.rules.contained]
        if targets and self.containment is not None:
            self.port.start_task(self._signal(targets, sig))

    async def _signal(self, targets: list[ChildProcess], sig: int) -> None:
        containment = self.containment
        for child in targets:
            # a reaped main's pid may already belong to someone else: never walk from it
            root = child.pid if child.alive else None
            if sig != signal.SIGKILL:
                await asyncio.to_thread(containment.send, child.name, root, sig, child.pid)
                continue
            if child.state == ChildState.LINGERING:
                left = await asyncio.to_thread(containment.members, child.name, None)
                if left:
                    self.killed_left += len(left)
                    child.killed = True
                    self.port.log.warning(f"{child.name}: {len(left)} process(es) it started still running "
                                          f"after SIGTERM ({_pids(left)}); SIGKILL")
            await asyncio.to_thread(containment.kill, child.name, root)

    def on_exit(self, child: ChildProcess) -> None:
        """Its main process was reaped: gone once nothing it started is left."""
        if not child.rules.contained or self.containment is None:
            child.fire(ChildEvent.EMPTIED)
            return
        if not self._watching:
            self._watching = True
            self.port.start_task(self._watch())

    def sentinel_reaped(self, pid: int, code: int) -> bool:
        """True when the exit reaped was the sentinel's (said when it was not our doing)."""
        if pid != self.sentinel_pid:
            return False
        self.sentinel_pid = None
        if not self.port.stopping:
            self.port.log.warning(f"containment: the sentinel exited with code {code}; if the supervisor is "
                                  f"SIGKILLed now, what the services started is ended at the next start")
        return True

    def on_sigchld(self) -> None:
        if self._nudge is not None and not self._nudge.done():
            self._nudge.set_result(None)

    async def _watch(self) -> None:
        """Look at every lingering service until each is empty: after every SIGCHLD (an
        adopted orphan reaped) and every LINGER_CHECK_S (a process reaped elsewhere)."""
        port, told = self.port, set()
        try:
            while True:
                lingering = [c for c in port.children if c.state == ChildState.LINGERING]
                if not lingering:
                    return
                for child in lingering:
                    left = await asyncio.to_thread(self.containment.members, child.name, None)
                    if not left:
                        port.post(ChildEmptied(child))
                    elif child.name not in told:
                        told.add(child.name)
                        port.log.warning(f"{child.name}: its main process exited; {len(left)} process(es) it "
                                         f"started are still running ({_pids(left)}); SIGTERM, SIGKILL after "
                                         f"grace_s")
                        await asyncio.to_thread(self.containment.send, child.name, None, signal.SIGTERM, None)
                self._nudge = asyncio.get_running_loop().create_future()
                sleeper = asyncio.ensure_future(port.clock.sleep(LINGER_CHECK_S))
                await asyncio.wait([self._nudge, sleeper], return_when=asyncio.FIRST_COMPLETED)
                sleeper.cancel()
                await asyncio.sleep(0)  # let the queued "emptied" events land first
        finally:
            self._watching = False

    # ---- the end ----------------------------------------------------------------------------
    async def end(self, reap: Callable[[], None]) -> set[int]:
        """The last sweep: SIGKILL whatever of the unit is still alive (its services'
        processes, orphans adopted by the subreaper); the pids that survived even that.
        `reap` reaps what is due (the driver's loop has ended: nobody else does now)."""
        port = self.port
        if self._prepared is not None and not self._prepared.done():
            await asyncio.wait({self._prepared}, timeout=10.0)
        survivors = await asyncio.to_thread(self._sweep)
        if survivors:
            port.log.error(f"{len(survivors)} process(es) the unit started are still alive after SIGKILL: "
                           f"{_pids(survivors)}")
        if self.containment is not None and not survivors:
            await asyncio.to_thread(self.containment.release)
        if self._sentinel_fd is not None:
            if not survivors:  # else the sentinel keeps trying once we are gone
                port.system.write(self._sentinel_fd, b"done")
            port.system.close(self._sentinel_fd)
            self._sentinel_fd = None
            await self._sentinel_reaped(reap, 0.5)  # reap it ourselves: no zombie left to whoever adopts it
            if self.sentinel_pid is not None and not survivors:
                # told it is done and still there (stopped, or stuck): nothing is left for it to
                # end, and a unit never exits 0 while a process it started is alive
                port.log.warning(f"the sentinel (pid {self.sentinel_pid}) did not end when told; SIGKILL")
                port.system.kill(self.sentinel_pid, signal.SIGKILL)
                await self._sentinel_reaped(reap, 1.0)
        return survivors

    async def _sentinel_reaped(self, reap: Callable[[], None], within_s: float) -> None:
        for _ in range(round(within_s / 0.01)):
            if self.sentinel_pid is None:
                return
            await asyncio.sleep(0.01)
            reap()

    def _collect(self, helpers: set[int]) -> set[int]:
        port, containment = self.port, self.containment
        left = port.system.own_children() - helpers
        if containment is not None:
            for child in port.children:  # every main is reaped by now: walk from none
                if child.rules.contained and child.pid is not None:
                    left |= containment.members(child.name, None)
        return left

    def _sweep(self) -> set[int]:
        """In a worker thread. Normally finds nothing: each service counted as gone only
        once empty. What it finds (an orphan that dropped the marker, say) gets SIGTERM,
        then SIGKILL after SWEEP_TERM_S (counted: work was lost)."""
        port, containment = self.port, self.containment
        helpers = {self.sentinel_pid} if self.sentinel_pid else set()
        left = self._collect(helpers)
        if not left:
            return set()
        port.log.warning(f"{len(left)} process(es) of the unit still running after its services exited "
                         f"({_pids(left)}); SIGTERM, SIGKILL after {SWEEP_TERM_S:g} s")
        for pid in left:
            port.system.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + SWEEP_TERM_S
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = self._collect(helpers)
        if left:
            self.killed_left += len(left)
        deadline = time.monotonic() + SWEEP_WAIT_S
        while left and time.monotonic() < deadline:
            for child in port.children:
                if containment is not None and child.rules.contained and child.pid is not None:
                    containment.kill(child.name, None)
            for pid in left:
                port.system.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
            left = self._collect(helpers)
        return left


def _pids(pids: set[int], limit: int = 10) -> str:
    shown = sorted(pids)[:limit]
    return "pids " + ", ".join(map(str, shown)) + (" ..." if len(pids) > limit else "")

"""The MPS control daemon as a supervised child: started before the services, adopted
when it detaches, watched like them (its death stops the unit with exit 6), told `quit`
after the last service is gone on every path, SIGKILLed if it will not go.

Its rules beside a service's: lifecycle.MPS. The client calls (`-d`, `quit`) are one-shot
children of the supervisor, reaped by its loop like every other child.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from supervisor.child import ChildProcess
from supervisor.lifecycle import EXIT_MPS_FAILED, MPS, Event, State
from supervisor.logs import Tail
from supervisor.mps import BINARY, MpsDaemon, MpsError
from supervisor.plan import ServicePlan

class MpsRunner:
    """`sup` is the driver (unit.Supervisor): its OS layer, clock, log, event queue,
    one-shot registry, adopt/attach_output/wait_exit/child_exited."""

    def __init__(self, sup: Any, gpu: Any, mps_dir: str):
        self.sup = sup
        self.daemon = MpsDaemon(mps_dir, gpu.mps_start_timeout_s, gpu.mps_stop_timeout_s)
        self.child = ChildProcess(ServicePlan("mps", "", 0, [BINARY, "-d"], {}, {}, 0), rules=MPS)
        self.stopped = False
        self._start_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.daemon.env()}

    async def oneshot(self, args: list[str], stdin: str | None, timeout: float) -> tuple[int | None, list[str]]:
        """Run the control client as a child of ours; (exit code or None on timeout, its output)."""
        sup = self.sup
        spawned = sup.os.spawn(self.daemon.argv(*args), self._env(), stdin.encode() if stdin is not None else None)
        exited = asyncio.get_running_loop().create_future()
        sup.oneshots[spawned.pid] = exited
        tail = Tail(10)
        eof = sup.attach_output("mps", spawned.output_fd, tail=tail)
        try:
            code: int | None = await asyncio.wait_for(asyncio.shield(exited), timeout)
        except asyncio.TimeoutError:
            sup.os.kill_group(spawned.pid, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            except asyncio.TimeoutError:
                pass
            code = None
        try:
            await asyncio.wait_for(asyncio.shield(eof), 1.0)
        except asyncio.TimeoutError:
            pass
        return code, tail.lines()

    # ---- start --------------------------------------------------------------------------------
    async def start(self) -> bool:
        self._start_task = asyncio.current_task()
        try:
            return await self._start()
        except MpsError as exc:
            self._fail(str(exc))
            return False
        finally:
            self._start_task = None

    def _fail(self, reason: str) -> None:
        self.sup.log.error(f"MPS: {reason}")
        self.sup.put("fail", EXIT_MPS_FAILED, f"MPS control daemon did not start: {reason}")

    async def _start(self) -> bool:
        d, sup = self.daemon, self.sup
        problem = d.problem()
        if problem:
            raise MpsError(problem)
        await asyncio.to_thread(d.prepare)
        state = await asyncio.to_thread(d.control_state)
        if state == "live":
            sup.log.info(f"MPS: a daemon from an earlier run holds {d.pipe_dir}; asking it to quit")
            await self.oneshot([], "quit\n", 5.0)
            await asyncio.to_thread(d.wait_gone, 5.0)
        if state != "absent":
            await asyncio.to_thread(d.remove_leftovers)
        if sup.unit.stopping:
            return False
        self.child.fire(Event.STARTED)
        self.child.started_at = sup.clock.now()
        code, out = await self.oneshot(["-d"], None, d.start_timeout_s)
        if code != 0:
            said = " ".join(line.strip() for line in out).strip()[:500]
            raise MpsError(f"{BINARY} -d failed with code {code}: {said}" if code is not None
                           else f"{BINARY} -d did not return within {d.start_timeout_s:g} s")
        pid, up = await asyncio.to_thread(d.wait_daemon, sup.os.getpid(), set(sup.oneshots), d.start_timeout_s)
        if pid is not None:
            sup.put("mps_adopt", pid)
        if not up:
            raise MpsError(f"MPS daemon did not create {d.control} within {d.start_timeout_s:g} s; "
                           f"see {d.log_dir}/control.log" + ("" if pid is not None else
                                                             " (no daemon process became our child)"))
        sup.put("mps_ready")
        return not sup.unit.stopping

    def on_event(self, kind: str, *args: Any) -> None:
        sup, child = self.sup, self.child
        if kind == "mps_adopt":
            pid = args[0]
            sup.adopt(child, pid)
            if pid in sup.reaped_orphans:  # it died before we knew it was the daemon
                sup._by_pid.pop(pid, None)
                sup.child_exited(child, -1)
        elif kind == "mps_ready" and child.alive:
            child.fire(Event.READY_OK)
            sup.log.info(f"MPS: control daemon started (pid {child.pid}, pipe {self.daemon.pipe_dir}, "
                         f"log {self.daemon.log_dir})")
        elif kind == "mps_stopped":
            self.stopped = True

    # ---- stop ---------------------------------------------------------------------------------
    def begin_stop(self) -> None:
        if self._stop_task is None:
            self._stop_task = self.sup.spawn_task(self._stop())

    def abort_start(self) -> None:
        """A second SIGINT: the client calls still running are killed (the daemon is told
        to quit after the services all the same)."""
        for pid in list(self.sup.oneshots):
            self.sup.os.kill_group(pid, signal.SIGKILL)

    async def _stop(self) -> None:
        d, sup, child = self.daemon, self.sup, self.child
        try:
            task = self._start_task
            if task is not None and not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), d.start_timeout_s + 2.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
            await asyncio.sleep(0)  # let a pending adoption land
            if child.alive:
                await self._quit(child)
            elif child.pid is None and child.state != State.PENDING:
                # started but never adopted: a daemon may still answer on the socket
                if await asyncio.to_thread(d.control_state) == "live":
                    await self.oneshot([], "quit\n", d.stop_timeout_s)
                    await asyncio.to_thread(d.wait_gone, d.stop_timeout_s)
            # else: it is dead (or never ran): no quit, no wait on its stale socket
            await asyncio.to_thread(d.remove_leftovers)
        except MpsError as exc:
            sup.log.error(f"MPS: {exc}")
        finally:
            if child.state != State.EXITED:
                child.fire(Event.TERM)
            sup.put("mps_stopped")

    async def _quit(self, child: ChildProcess) -> None:
        d, sup = self.daemon, self.sup
        child.fire(Event.TERM)
        exited = sup.wait_exit(child.pid)
        if await asyncio.to_thread(d.control_state) != "live":
            sup.log.warning("MPS: the control daemon does not answer on its socket; SIGKILL")
            self.kill_now()
            try:
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            except asyncio.TimeoutError:
                pass
            return
        code, out = await self.oneshot([], "quit\n", d.stop_timeout_s)
        if code not in (0, None) and not exited.done():
            sup.log.warning(f"MPS: quit answered code {code}: {' '.join(out)[:300]}")
        try:
            await asyncio.wait_for(asyncio.shield(exited), d.stop_timeout_s)
            sup.log.info("MPS: control daemon stopped")
        except asyncio.TimeoutError:
            sup.log.warning(f"MPS: the control daemon did not quit within {d.stop_timeout_s:g} s; SIGKILL")
            self.kill_now()
            try:
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            except asyncio.TimeoutError:
                pass

    def kill_now(self) -> None:
        child = self.child
        if child.alive and child.pid is not None:
            self.sup.os.kill_group(child.pid, signal.SIGKILL)
            self.sup.os.kill(child.pid, signal.SIGKILL)

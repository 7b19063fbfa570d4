"""The MPS control daemon as a supervised child: started before the services, adopted
when it detaches, watched like them (its death stops the unit with exit 6), told `quit`
after the last service is gone on every path, SIGKILLed if it will not go.

Its rules beside a service's: child_lifecycle.MPS. The client calls (`-d`, `quit`) are
one-shot children of the supervisor, reaped by its loop like every other child (reaper.py).
The daemon's files, binary and process are system/mps_control.py's.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

from supervisor.config.settings import GpuSettings
from supervisor.driver.child import ChildProcess
from supervisor.driver.child_output import ChildOutput
from supervisor.driver.events import ChildExited, Handlers, UnitFailed
from supervisor.driver.logs import Tail
from supervisor.driver.port import DriverPort
from supervisor.driver.reaper import Reaper
from supervisor.policy.child_lifecycle import MPS, ChildEvent, ChildState
from supervisor.policy.exit_codes import EXIT_MPS_FAILED
from supervisor.policy.plan import ServicePlan
from supervisor.system.mps_control import BINARY, MpsControl, MpsError


@dataclass(frozen=True)
class MpsAdopted:
    """The detached daemon was found among our children: it is the `mps` child now."""
    pid: int


@dataclass(frozen=True)
class MpsReady:
    """Its control socket answers."""


@dataclass(frozen=True)
class MpsStopped:
    """It was told to quit (or killed) after the services, and its leftovers are removed."""


class MpsChild:
    def __init__(self, port: DriverPort, reaper: Reaper, output: ChildOutput, gpu: GpuSettings, mps_dir: str):
        self.port = port
        self.reaper = reaper
        self.output = output
        self.control = MpsControl(mps_dir, gpu.mps_start_timeout_s, gpu.mps_stop_timeout_s)
        self.child = ChildProcess(ServicePlan("mps", "", 0, [BINARY, "-d"], {}, {}, 0), rules=MPS)
        self.stopped = False
        self._start_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    def handlers(self) -> Handlers:
        return {MpsAdopted: self._on_adopted, MpsReady: self._on_ready, MpsStopped: self._on_stopped}

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.control.env()}

    async def oneshot(self, args: list[str], stdin: str | None, timeout: float) -> tuple[int | None, list[str]]:
        """Run the control client as a child of ours; (exit code or None on timeout, its output)."""
        system = self.port.system
        spawned = system.spawn(self.control.argv(*args), self._env(), stdin.encode() if stdin is not None else None)
        exited = self.reaper.expect_oneshot(spawned.pid)
        tail = Tail(10)
        eof = self.output.attach("mps", spawned.output_fd, tail=tail)
        try:
            code: int | None = await asyncio.wait_for(asyncio.shield(exited), timeout)
        except TimeoutError:
            system.kill_group(spawned.pid, signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            except TimeoutError:
                pass
            code = None
        try:
            await asyncio.wait_for(asyncio.shield(eof), 1.0)
        except TimeoutError:
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
        self.port.log.error(f"MPS: {reason}")
        self.port.post(UnitFailed(EXIT_MPS_FAILED, f"MPS control daemon did not start: {reason}"))

    async def _start(self) -> bool:
        control, port = self.control, self.port
        problem = control.problem()
        if problem:
            raise MpsError(problem)
        await asyncio.to_thread(control.prepare)
        state = await asyncio.to_thread(control.control_state)
        if state == "live":
            port.log.info(f"MPS: a daemon from an earlier run holds {control.pipe_dir}; asking it to quit")
            await self.oneshot([], "quit\n", 5.0)
            await asyncio.to_thread(control.wait_gone, 5.0)
        if state != "absent":
            await asyncio.to_thread(control.remove_leftovers)
        if port.stopping:
            return False
        self.child.fire(ChildEvent.STARTED)
        self.child.started_at = port.clock.now()
        code, out = await self.oneshot(["-d"], None, control.start_timeout_s)
        if code != 0:
            said = " ".join(line.strip() for line in out).strip()[:500]
            raise MpsError(f"{BINARY} -d failed with code {code}: {said}" if code is not None
                           else f"{BINARY} -d did not return within {control.start_timeout_s:g} s")
        pid, up = await asyncio.to_thread(control.wait_daemon, port.system.getpid(), self.reaper.oneshot_pids(),
                                          control.start_timeout_s)
        if pid is not None:
            port.post(MpsAdopted(pid))
        if not up:
            raise MpsError(f"MPS daemon did not create {control.control} within {control.start_timeout_s:g} s; "
                           f"see {control.log_dir}/control.log" + ("" if pid is not None else
                                                             " (no daemon process became our child)"))
        port.post(MpsReady())
        return not port.stopping

    def _on_adopted(self, event: MpsAdopted) -> list[ChildExited] | None:
        if not self.reaper.adopt(self.child, event.pid, self.port.clock.now(), detached=True):
            return [ChildExited(self.child, -1)]  # it died before we knew it was the daemon
        return None

    def _on_ready(self, _: MpsReady) -> None:
        child = self.child
        if child.alive:
            child.fire(ChildEvent.READY_OK)
            self.port.log.info(f"MPS: control daemon started (pid {child.pid}, pipe {self.control.pipe_dir}, "
                               f"log {self.control.log_dir})")

    def _on_stopped(self, _: MpsStopped) -> None:
        self.stopped = True

    # ---- stop ---------------------------------------------------------------------------------
    def begin_stop(self) -> None:
        if self._stop_task is None:
            self._stop_task = self.port.start_task(self._stop())

    def abort_start(self) -> None:
        """A second SIGINT: the client calls still running are killed (the daemon is told
        to quit after the services all the same)."""
        for pid in self.reaper.oneshot_pids():
            self.port.system.kill_group(pid, signal.SIGKILL)

    async def _stop(self) -> None:
        control, port, child = self.control, self.port, self.child
        try:
            task = self._start_task
            if task is not None and not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), control.start_timeout_s + 2.0)
                except (TimeoutError, asyncio.CancelledError):
                    pass
            await asyncio.sleep(0)  # let a pending adoption land
            if child.alive:
                await self._quit(child)
            elif child.pid is None and child.state != ChildState.PENDING:
                # started but never adopted: a daemon may still answer on the socket
                if await asyncio.to_thread(control.control_state) == "live":
                    await self.oneshot([], "quit\n", control.stop_timeout_s)
                    await asyncio.to_thread(control.wait_gone, control.stop_timeout_s)
            # else: it is dead (or never ran): no quit, no wait on its stale socket
            await asyncio.to_thread(control.remove_leftovers)
        except MpsError as exc:
            port.log.error(f"MPS: {exc}")
        finally:
            if child.state != ChildState.EXITED:
                child.fire(ChildEvent.TERM)
            port.post(MpsStopped())

    async def _quit(self, child: ChildProcess) -> None:
        control, port = self.control, self.port
        child.fire(ChildEvent.TERM)
        exited = self.reaper.wait_exit(child.pid)
        if await asyncio.to_thread(control.control_state) != "live":
            port.log.warning("MPS: the control daemon does not answer on its socket; SIGKILL")
            self.kill_now()
            try:
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            except TimeoutError:
                pass
            return
        code, out = await self.oneshot([], "quit\n", control.stop_timeout_s)
        if code not in (0, None) and not exited.done():
            port.log.warning(f"MPS: quit answered code {code}: {' '.join(out)[:300]}")
        try:
            await asyncio.wait_for(asyncio.shield(exited), control.stop_timeout_s)
            port.log.info("MPS: control daemon stopped")
        except TimeoutError:
            port.log.warning(f"MPS: the control daemon did not quit within {control.stop_timeout_s:g} s; SIGKILL")
            self.kill_now()
            try:
                await asyncio.wait_for(asyncio.shield(exited), 2.0)
            except TimeoutError:
                pass

    def kill_now(self) -> None:
        child = self.child
        if child.alive and child.pid is not None:
            self.port.system.kill_group(child.pid, signal.SIGKILL)
            self.port.system.kill(child.pid, signal.SIGKILL)

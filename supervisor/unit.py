"""The driver: one loop that turns what happens (signals, reaped children, probe answers,
timers) into events for the lifecycle tables (lifecycle.py) and carries out what they say.

Signal handlers, probe tasks, timers and the sampler thread only enqueue; `_dispatch`
applies one event at a time, so the policy is sequential and a scripted history replays
the same way (tests/unit/test_policy.py). Nothing on this loop blocks: logs go through a
bounded buffer (logs.py), process-table and NVML figures come from a worker thread
(sampler.py), filesystem and process-table look-ups run in worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from supervisor import report
from supervisor.child import ChildProcess
from supervisor.clock import Clock, LoopClock, Timer
from supervisor.descendants import Descendants
from supervisor.early import quiet_thread
from supervisor.endpoints import Endpoints
from supervisor.watch import ServiceWatch
from supervisor.lifecycle import (EXIT_SETUP, EXIT_SPAWN_FAILED, HANDLED_SIGNALS,
                                  IGNORED_SIGNALS, INTERRUPT_SIGNALS, STOP_SIGNALS,
                                  Action, Event, State, Unit, UnitEvent, UnitState)
from supervisor.logs import LogSink
from supervisor.output import ChildOutput
from supervisor.mpsrun import MpsRunner
from supervisor.oslayer import OsLayer, exit_code_of
from supervisor.plan import Plan
from supervisor.probe import ChildProber, http_get
from supervisor.sampler import Sampler

if TYPE_CHECKING:
    from supervisor.config import Config

HANDLED = HANDLED_SIGNALS
LOG_REPEAT_S = 10.0


class Supervisor:
    def __init__(self, config: "Config", plan: Plan, *, os_layer: OsLayer | None = None,
                 clock: Clock | None = None, log: LogSink | None = None, prober: Any = None,
                 gpu: Any = None, sampler: Sampler | None = None, port_check: Any = None):
        self.config = config
        self.settings = config.supervisor
        self.plan = plan
        self.os = os_layer or OsLayer()
        self.clock = clock or LoopClock()
        self.log = log or LogSink(self.settings.log_format, max_lines=self.settings.log_buffer_lines)
        self.probes = prober if isinstance(prober, ChildProber) else ChildProber(prober or http_get)
        self.unit = Unit()
        self.children = [ChildProcess(p) for p in plan.services]
        self.mps = MpsRunner(self, config.gpu, plan.mps_dir) if plan.mps_dir else None
        if sampler is None:
            from supervisor.cpuquota import ThrottleWindow
            from supervisor.gpu import GpuFacts
            sampler = Sampler(gpu or GpuFacts(config.gpu.visible_devices), ThrottleWindow(plan.quota),
                              self.settings.sample_period_s)
        self.sampler = sampler
        if port_check is None:
            from supervisor.ports import port_problem as port_check
        self.port_check = port_check
        self._by_pid: dict[int, ChildProcess] = {}
        self.oneshots: dict[int, asyncio.Future] = {}
        self._exit_waiters: dict[int, list[asyncio.Future]] = collections.defaultdict(list)
        self._events: asyncio.Queue[tuple] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self.started_at = self.clock.now()
        self.all_ready_at: float | None = None
        self.orphans_reaped = 0
        self.reaped_orphans: collections.deque[int] = collections.deque(maxlen=256)
        self._grace_timer: Timer | None = None
        self._startup_timer: Timer | None = None
        self.endpoints = Endpoints(self)
        self.watch = ServiceWatch(self)
        self.descendants = Descendants(self)
        self.output = ChildOutput(self)
        self._last_logged: dict[str, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- what others call: enqueue only ---------------------------------------------------
    def put(self, *event: Any) -> None:
        self._events.put_nowait(event)

    def handle_signal(self, sig: int) -> None:
        self.put("signal", sig)

    def handle_sigchld(self) -> None:
        self.put("sigchld")

    def spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- main loop ----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = self.loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_exception)
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="onecard-worker", initializer=quiet_thread))
        code = await self.endpoints.open()
        if code is not None:
            self.log.flush(2.0)
            return code
        for sig in STOP_SIGNALS + INTERRUPT_SIGNALS:
            loop.add_signal_handler(sig, self.handle_signal, sig)
        loop.add_signal_handler(signal.SIGCHLD, self.handle_sigchld)
        ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in IGNORED_SIGNALS}
        # Held since the first instruction of `onecard run` (early.py) and across the exec:
        # whatever arrived meanwhile is delivered now, to the handlers, and queued.
        self.os.release_signals(HANDLED)
        survivors: set[int] = set()
        try:
            self.os.become_subreaper()
            self.os.raise_open_files_limit()
            for warning in self.plan.warnings:
                self.log.warning(warning)
            self.sampler.extra.append(self.endpoints.watch_control_socket)
            self.sampler.start()
            self._startup_timer = self.clock.call_later(self.settings.startup_timeout_s,
                                                        lambda: self.put("startup_deadline"))
            self.spawn_task(self._prepare())
            self._on_sigchld()  # a child may have died before the handler was installed
            while self.unit.state != UnitState.DONE:
                self._dispatch(await self._events.get())
                self._progress()
            await self.output.drain(self._events, self._on_sigchld)
        finally:
            for task in list(self._tasks):
                task.cancel()
            for timer in (self._grace_timer, self._startup_timer):
                if timer is not None:
                    timer.cancel()
            self._kill_stragglers()
            survivors = await self.descendants.end()
            self._on_sigchld()
            # From here to the process's exit a signal waits: a late one can neither replace
            # the exit code chosen below nor cut the teardown and the last lines short.
            self.os.hold_signals(HANDLED)
            for sig in HANDLED:
                loop.remove_signal_handler(sig)
            for sig, old in ignored.items():
                signal.signal(sig, old)
            self.sampler.stop()
            await self.endpoints.close()
        code = self.unit.exit_code([c.exit_code for c in self.children if c.pid is not None],
                                   self.descendants.killed_left, len(survivors))
        self.log.info(f"exit {code}: {self.unit.reason}")
        self.log.flush(2.0)
        return code

    async def _prepare(self) -> None:
        """Before any service: its containment (and the end of what an earlier run left,
        which may hold the ports), every port free, then the MPS daemon (when on)."""
        await self.descendants.prepare()
        problems = []
        for c in self.children:
            p = await asyncio.to_thread(self.port_check, c.plan.host, c.plan.port)
            if p:
                problems.append(f"services.{c.name}.port: {p}")
        if problems:
            for p in problems:
                self.log.error(p)
            self.put("fail", EXIT_SETUP, "; ".join(problems))
            return
        if self.mps is not None and not await self.mps.start():
            return
        self.put("spawn_services")

    def _dispatch(self, event: tuple) -> None:
        kind, args = event[0], event[1:]
        if kind == "sigchld":
            self._on_sigchld()
        elif kind == "signal":
            self._on_signal(*args)
        elif kind == "fail":
            self.apply(self.unit.fire(UnitEvent.FAIL, *args))
        elif kind == "spawn_services":
            self._spawn_services()
        elif kind == "emptied":
            args[0].fire(Event.EMPTIED)
        elif kind == "ready_probe":
            self.watch.on_ready_probe(*args)
        elif kind == "watch_probe":
            self.watch.on_watch(*args)
        elif kind == "startup_deadline":
            self.watch.on_startup_deadline()
        elif kind == "grace":
            self._on_grace()
        elif kind == "stop_request":
            self._stop(UnitEvent.STOP, "`onecard stop` requested")
        elif kind == "control_socket_gone":
            self.endpoints.on_control_socket_gone()
        elif kind.startswith("mps_") and self.mps is not None:
            self.mps.on_event(kind, *args)

    def _progress(self) -> None:
        """Conditions over several children: all ready, all gone."""
        if not self.unit.stopping:
            if self.all_ready_at is None and self.children and all(c.state == State.READY for c in self.children):
                self.all_ready_at = self.clock.now()
                if self._startup_timer is not None:
                    self._startup_timer.cancel()
                self.log.info(f"all services ready in {self.all_ready_at - self.started_at:.2f} s")
                self.apply(self.unit.fire(UnitEvent.ALL_READY))
            return
        if any(c.state != State.EXITED for c in self.children):
            return
        if self.mps is not None and not self.mps.stopped:
            self.mps.begin_stop()
            return
        self.apply(self.unit.fire(UnitEvent.ALL_EXITED))

    def apply(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if action == Action.TERMINATE:
                if self._startup_timer is not None:
                    self._startup_timer.cancel()
                for child in self.children:
                    was_alive = child.alive
                    child.fire(Event.TERM)
                    if was_alive:
                        self.os.kill_group(child.pid, signal.SIGTERM)
                self.descendants.signal_all(self.children, signal.SIGTERM)
                if self._grace_timer is None:
                    self._grace_timer = self.clock.call_later(self.settings.grace_s, lambda: self.put("grace"))
            elif action == Action.KILL:
                for child in self.children:
                    if child.alive:
                        child.killed = True
                    if child.pid is not None:
                        self.os.kill_group(child.pid, signal.SIGKILL)
                self.descendants.signal_all(self.children, signal.SIGKILL)
                if self.mps is not None:
                    self.mps.abort_start()

    def _stop(self, event: UnitEvent, reason: str) -> None:
        if not self.unit.stopping:
            self.log.info(f"{reason}: draining every service (drain {self.plan.services[0].drain_s:g} s, "
                          f"grace {self.settings.grace_s:g} s)" if self.plan.services else reason)
        self.apply(self.unit.fire(event, 0, reason))

    # ---- children -----------------------------------------------------------------------------
    def _spawn_services(self) -> None:
        if self.unit.stopping:
            return
        for child in self.children:
            child.token = secrets.token_hex(8)
            env = {**child.plan.env, **self.descendants.env(), "ONECARD_INSTANCE_TOKEN": child.token}
            try:
                spawned = self.os.spawn(child.plan.argv, env, join=self.descendants.join_path(child))
            except (OSError, subprocess.SubprocessError) as exc:
                reason = f"{child.name}: cannot start {child.plan.argv[0]!r}: {exc}"
                self.log.error(reason)
                self.apply(self.unit.fire(UnitEvent.FAIL, EXIT_SPAWN_FAILED, reason))
                return
            self.adopt(child, spawned.pid)
            self.attach_output(child.name, spawned.output_fd, child)
            self.log.info(f"{child.name}: started pid {child.pid} on {child.plan.host}:{child.plan.port}")
            self.spawn_task(self.watch.probe_loop(child))
        self.sampler.targets = {c.name: c.pid for c in self.children if c.alive}
        self.sampler.request()

    def adopt(self, child: ChildProcess, pid: int) -> None:
        child.pid = pid
        child.started_at = self.clock.now()
        child.fire(Event.STARTED)
        self._by_pid[pid] = child

    def attach_output(self, tag: str, fd: int, child: ChildProcess | None = None,
                      tail: Any = None) -> asyncio.Future:
        return self.output.attach(tag, fd, child, tail)

    def wait_exit(self, pid: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._exit_waiters[pid].append(fut)
        return fut

    def reap_now(self) -> None:
        self._on_sigchld()

    def _on_sigchld(self) -> None:
        self.descendants.on_sigchld()
        for pid, status in self.os.reap():
            code = exit_code_of(status)
            if pid == self.descendants.sentinel_pid:
                self.descendants.sentinel_pid = None
                if not self.unit.stopping:
                    self.log.warning(f"containment: the sentinel exited with code {code}; if the supervisor is "
                                     f"SIGKILLed now, what the services started is ended at the next start")
                continue
            for fut in self._exit_waiters.pop(pid, []):
                if not fut.done():
                    fut.set_result(code)
            shot = self.oneshots.pop(pid, None)
            if shot is not None:
                if not shot.done():
                    shot.set_result(code)
                continue
            child = self._by_pid.pop(pid, None)
            if child is None:
                # An orphan re-parented to us (PID 1 or subreaper): reap it, nothing more.
                self.orphans_reaped += 1
                self.reaped_orphans.append(pid)
                continue
            self.child_exited(child, code)

    def child_exited(self, child: ChildProcess, code: int) -> None:
        told = child.state == State.STOPPING
        child.fire(Event.EXITED)
        self.descendants.on_exit(child)
        child.exit_code = code
        child.exited_at = self.clock.now()
        self.sampler.targets = {c.name: c.pid for c in self.children if c.alive}
        if told or self.unit.stopping:
            how = " (killed after the grace period)" if child.killed else (
                " (it was told to stop)" if told else "")
            self.log.info(f"{child.name}: exited with code {code}{how}")
            return
        unit_code, reason = child.rules.unexpected_exit(child.name, code)
        self.log.error(f"{child.name}: exited with code {code}; stopping every service")
        self.apply(self.unit.fire(UnitEvent.FAIL, unit_code, reason))

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if sig in INTERRUPT_SIGNALS:
            if self.unit.stopping:
                self.log.warning("second SIGINT: killing every service now")
                self.apply(self.unit.fire(UnitEvent.INTERRUPT))
            else:
                self._stop(UnitEvent.INTERRUPT, f"{name} received")
        elif self.unit.stopping:  # a storm of them is one line every LOG_REPEAT_S
            self.log_once(f"signal-while-stopping:{name}", "info",
                          f"{name} received while stopping: still waiting (a second SIGINT skips the wait)")
        else:
            self._stop(UnitEvent.STOP, f"{name} received")

    def _on_grace(self) -> None:
        self._on_sigchld()  # a frozen supervisor resumes with exits and the timer both due: exits first
        for child in self.children:
            if child.alive:
                self.log.warning(f"{child.name}: still running {self.settings.grace_s:g} s after SIGTERM; SIGKILL")
        self.apply(self.unit.fire(UnitEvent.GRACE_EXPIRED))

    def view(self, sample=None) -> report.UnitView:
        return report.UnitView(
            pid=self.os.getpid(), unit=self.unit, now=self.clock.now(), started_at=self.started_at,
            all_ready_at=self.all_ready_at, children=self.children,
            mps=self.mps.child if self.mps else None,
            mps_pipe_dir=str(self.mps.daemon.pipe_dir) if self.mps else None,
            sample=sample or self.sampler.latest, quota=self.plan.quota, orphans_reaped=self.orphans_reaped,
            log_dropped=self.log.dropped, probe_refused=self.endpoints.probe_refused())

    def log_once(self, key: str, level: str, text: str) -> None:
        now = self.clock.now()
        last = self._last_logged.get(key)
        if last is not None and now - last < LOG_REPEAT_S:
            return
        self._last_logged[key] = now
        self.log.line("onecard", text, level)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        msg = context.get("message", "unexpected error")
        self.log_once(f"loop:{msg}", "error", f"event loop: {msg}" + (
            f": {type(exc).__name__}: {exc}" if exc is not None else ""))

    # ---- the end ------------------------------------------------------------------------------
    def _kill_stragglers(self) -> None:
        for child in self.children:
            if child.pid is not None:
                self.os.kill_group(child.pid, signal.SIGKILL)
        if self.mps is not None:
            self.mps.kill_now()
        for pid in list(self.oneshots):
            self.os.kill_group(pid, signal.SIGKILL)
        self._on_sigchld()

"""The driver: one loop that turns what happens (signals, reaped children, probe answers,
timers) into events for the lifecycle tables (policy/) and carries out what they say.

Signal handlers, probe tasks, timers and the sampler thread only post events (port.py);
`_dispatch` applies one at a time through a table (event type -> handler), so the policy
is sequential and a scripted history replays the same way (tests/unit/test_driver_*.py).
Nothing on this loop blocks: logs go through a bounded buffer (logs.py), process-table
and NVML figures come from a worker thread (sampler.py), filesystem and process-table
look-ups run in worker threads.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from supervisor.config.settings import GpuSettings, SupervisorSettings
from supervisor.driver import report
from supervisor.driver.child import ChildProcess
from supervisor.driver.child_output import ChildOutput
from supervisor.driver.child_probe import ChildProber, Prober, http_get
from supervisor.driver.descendants import Descendants
from supervisor.driver.endpoints import Endpoints
from supervisor.driver.events import (
    ChildExited,
    ChildrenChanged,
    GraceExpired,
    Handlers,
    ServicesMayStart,
    SignalReceived,
    StopRequested,
    TimerEvent,
    UnitFailed,
)
from supervisor.driver.logs import LogSink
from supervisor.driver.mps_child import MpsChild
from supervisor.driver.port import DriverPort
from supervisor.driver.reaper import Reaper
from supervisor.driver.sampler import Sample, Sampler
from supervisor.driver.service_watch import ServiceWatch, StartupDeadline
from supervisor.policy.child_lifecycle import ChildEvent, ChildState
from supervisor.policy.exit_codes import EXIT_SETUP, EXIT_SPAWN_FAILED
from supervisor.policy.plan import Plan
from supervisor.policy.signals import HANDLED_SIGNALS, IGNORED_SIGNALS, INTERRUPT_SIGNALS, STOP_SIGNALS
from supervisor.policy.unit_lifecycle import Action, UnitEvent, UnitLifecycle, UnitState
from supervisor.system.clock import Clock, LoopClock, Timer
from supervisor.system.os_layer import OsLayer, exit_code_of
from supervisor.system.signal_mask import quiet_thread

if TYPE_CHECKING:
    from supervisor.system.nvml import GpuFacts

PortCheck = Callable[[str, int], str | None]  # (host, port) -> why it cannot be bound, or None


class Supervisor:
    def __init__(self, settings: SupervisorSettings, gpu: GpuSettings, plan: Plan, *, system: OsLayer | None = None,
                 clock: Clock | None = None, log: LogSink | None = None, prober: Prober | ChildProber | None = None,
                 gpu_facts: GpuFacts | None = None, sampler: Sampler | None = None,
                 port_check: PortCheck | None = None):
        """Everything it talks to can be replaced (tests/fakes/): the OS layer, the clock, the
        log, the probe client, the GPU facts, the sampler, the port check."""
        self.settings = settings
        self.plan = plan
        self.system = system or OsLayer()
        self.clock = clock or LoopClock()
        self.log = log or LogSink(settings.log_format, max_lines=settings.log_buffer_lines)
        self.unit = UnitLifecycle()
        self.children = [ChildProcess(p) for p in plan.services]
        self.port = DriverPort(settings, self.system, self.clock, self.log, self.unit, self.children)
        self.reaper = Reaper()
        self.probes = prober if isinstance(prober, ChildProber) else ChildProber(prober or http_get)
        if sampler is None:
            from supervisor.system.cpu_cgroup import ThrottleWindow
            from supervisor.system.nvml import GpuFacts
            sampler = Sampler(gpu_facts or GpuFacts(gpu.visible_devices), ThrottleWindow(plan.quota),
                              settings.sample_period_s)
        self.sampler = sampler
        if port_check is None:
            from supervisor.system.ports import port_problem as port_check
        self.port_check = port_check
        self.output = ChildOutput(self.port)
        self.watch = ServiceWatch(self.port, self.probes)
        self.descendants = Descendants(self.port)
        self.mps = MpsChild(self.port, self.reaper, self.output, gpu, plan.mps_dir) if plan.mps_dir else None
        self.endpoints = Endpoints(self.port, plan.run_dir, self.sampler, self.view)
        self.started_at = self.clock.now()
        self.all_ready_at: float | None = None
        self._grace_timer: Timer | None = None
        self._startup_timer: Timer | None = None
        self._handlers = _dispatch_table({
            ChildrenChanged: lambda _: self._reap(),
            SignalReceived: self._on_signal,
            UnitFailed: lambda e: self._fail(e.code, e.reason),
            ServicesMayStart: self._on_services_may_start,
            ChildExited: self._on_child_exited,
            StopRequested: lambda _: self._stop(UnitEvent.STOP, "`onecard stop` requested"),
            GraceExpired: self._on_grace_expired,
        }, self.watch.handlers(), self.descendants.handlers(), self.endpoints.handlers(),
            self.mps.handlers() if self.mps is not None else {})

    # ---- what signal handlers call: enqueue only ------------------------------------------
    def handle_signal(self, sig: int) -> None:
        self.port.post(SignalReceived(sig))

    def handle_sigchld(self) -> None:
        self.port.post(ChildrenChanged())

    # ---- main loop ----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = self.port.loop = asyncio.get_running_loop()
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
        # Held since the first instruction of `onecard run` (cli/early.py) and across the exec:
        # whatever arrived meanwhile is delivered now, to the handlers, and queued.
        self.system.release_signals(HANDLED_SIGNALS)
        survivors: set[int] = set()
        try:
            self.system.become_subreaper()
            self.system.raise_open_files_limit()
            for warning in self.plan.warnings:
                self.log.warning(warning)
            self.sampler.extra.append(self.endpoints.watch_control_socket)
            self.sampler.start()
            self._startup_timer = self.clock.call_later(self.settings.startup_timeout_s,
                                                        lambda: self.port.post(StartupDeadline()))
            self.port.start_task(self._prepare())
            self._reap()  # a child may have died before the handler was installed
            while self.unit.state != UnitState.DONE:
                self._dispatch(await self.port.events.get())
                self._progress()
            await self.output.drain(self.port.events, self._reap)
        finally:
            self.port.cancel_tasks()
            for timer in (self._grace_timer, self._startup_timer):
                if timer is not None:
                    timer.cancel()
            self._kill_stragglers()
            survivors = await self.descendants.end(self._reap)
            self._reap()
            # From here to the process's exit a signal waits: a late one can neither replace
            # the exit code chosen below nor cut the teardown and the last lines short.
            self.system.hold_signals(HANDLED_SIGNALS)
            for sig in HANDLED_SIGNALS:
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
            self.port.post(UnitFailed(EXIT_SETUP, "; ".join(problems)))
            return
        if self.mps is not None and not await self.mps.start():
            return
        self.port.post(ServicesMayStart())

    def _dispatch(self, event: object) -> None:
        if isinstance(event, TimerEvent):
            self._reap()
        for follow_up in self._handlers[type(event)](event) or ():
            self._dispatch(follow_up)

    def _progress(self) -> None:
        """Conditions over several children: all ready, all gone."""
        if not self.unit.stopping:
            if self.all_ready_at is None and self.children and all(c.state == ChildState.READY
                                                                     for c in self.children):
                self.all_ready_at = self.clock.now()
                if self._startup_timer is not None:
                    self._startup_timer.cancel()
                self.log.info(f"all services ready in {self.all_ready_at - self.started_at:.2f} s")
                self.apply(self.unit.fire(UnitEvent.ALL_READY))
            return
        if any(c.state != ChildState.EXITED for c in self.children):
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
                    child.fire(ChildEvent.TERM)
                    if was_alive:
                        self.system.kill_group(child.pid, signal.SIGTERM)
                        # a stopped (SIGSTOP) process holds its SIGTERM until it runs again: it
                        # was SIGKILLed at grace and the stop lost its work (75); s6 and systemd
                        # follow a stop's SIGTERM with a SIGCONT too
                        self.system.kill_group(child.pid, signal.SIGCONT)
                self.descendants.signal_all(self.children, signal.SIGTERM)
                if self._grace_timer is None:
                    self._grace_timer = self.clock.call_later(self.settings.grace_s,
                                                              lambda: self.port.post(GraceExpired()))
            elif action == Action.KILL:
                for child in self.children:
                    if child.alive:
                        child.killed = True
                    if child.pid is not None:
                        self.system.kill_group(child.pid, signal.SIGKILL)
                self.descendants.signal_all(self.children, signal.SIGKILL)
                if self.mps is not None:
                    self.mps.abort_start()

    def _fail(self, code: int, reason: str) -> None:
        self.apply(self.unit.fire(UnitEvent.FAIL, code, reason))

    def _stop(self, event: UnitEvent, reason: str) -> None:
        if not self.unit.stopping:
            self.log.info(f"{reason}: draining every service (drain {self.plan.services[0].drain_s:g} s, "
                          f"grace {self.settings.grace_s:g} s)" if self.plan.services else reason)
        self.apply(self.unit.fire(event, 0, reason))

    # ---- children -----------------------------------------------------------------------------
    def _on_services_may_start(self, _: ServicesMayStart) -> None:
        if self.unit.stopping:
            return
        for child in self.children:
            child.token = secrets.token_hex(8)
            env = {**child.plan.env, **self.descendants.env(), "ONECARD_INSTANCE_TOKEN": child.token}
            try:
                spawned = self.system.spawn(child.plan.argv, env, join=self.descendants.join_path(child))
            except (OSError, subprocess.SubprocessError) as exc:
                reason = f"{child.name}: cannot start {child.plan.argv[0]!r}: {exc}"
                self.log.error(reason)
                self._fail(EXIT_SPAWN_FAILED, reason)
                return
            self.reaper.adopt(child, spawned.pid, self.clock.now())
            self.output.attach(child.name, spawned.output_fd, child)
            self.log.info(f"{child.name}: started pid {child.pid} on {child.plan.host}:{child.plan.port}")
            self.port.start_task(self.watch.probe_loop(child))
        self.sampler.targets = {c.name: c.pid for c in self.children if c.alive}
        self.sampler.request()

    def _reap(self) -> None:
        """Every exit that is due, each to its owner (reaper.py)."""
        self.descendants.on_sigchld()
        for pid, status in self.system.reap():
            code = exit_code_of(status)
            if self.descendants.sentinel_reaped(pid, code):
                continue
            child = self.reaper.settle(pid, code)
            if child is not None:
                self._on_child_exited(ChildExited(child, code))

    def _on_child_exited(self, event: ChildExited) -> None:
        child, code = event.child, event.code
        told = child.state == ChildState.STOPPING
        child.fire(ChildEvent.EXITED)
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
        self._fail(unit_code, reason)

    def _on_signal(self, event: SignalReceived) -> None:
        sig = event.sig
        name = signal.Signals(sig).name
        if sig in INTERRUPT_SIGNALS:
            if self.unit.stopping:
                self.log.warning("second SIGINT: killing every service now")
                self.apply(self.unit.fire(UnitEvent.INTERRUPT))
            else:
                self._stop(UnitEvent.INTERRUPT, f"{name} received")
        elif self.unit.stopping:  # a storm of them is one line every LOG_REPEAT_S
            self.port.log_once(f"signal-while-stopping:{name}", "info",
                               f"{name} received while stopping: still waiting (a second SIGINT skips the wait)")
        else:
            self._stop(UnitEvent.STOP, f"{name} received")

    def _on_grace_expired(self, _: GraceExpired) -> None:
        for child in self.children:
            if child.alive:
                self.log.warning(f"{child.name}: still running {self.settings.grace_s:g} s after SIGTERM; SIGKILL")
        self.apply(self.unit.fire(UnitEvent.GRACE_EXPIRED))

    def view(self, sample: Sample | None = None) -> report.UnitView:
        return report.UnitView(
            pid=self.system.getpid(), unit=self.unit, now=self.clock.now(), started_at=self.started_at,
            all_ready_at=self.all_ready_at, children=self.children,
            mps=self.mps.child if self.mps else None,
            mps_pipe_dir=str(self.mps.control.pipe_dir) if self.mps else None,
            sample=sample or self.sampler.latest, quota=self.plan.quota,
            orphans_reaped=self.reaper.orphans_reaped, log_dropped=self.log.dropped,
            probe_refused=self.endpoints.probe_refused())

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        msg = context.get("message", "unexpected error")
        self.port.log_once(f"loop:{msg}", "error", f"event loop: {msg}" + (
            f": {type(exc).__name__}: {exc}" if exc is not None else ""))

    # ---- the end ------------------------------------------------------------------------------
    def _kill_stragglers(self) -> None:
        for child in self.children:
            if child.pid is not None:
                self.system.kill_group(child.pid, signal.SIGKILL)
        if self.mps is not None:
            self.mps.kill_now()
        for pid in self.reaper.oneshot_pids():
            self.system.kill_group(pid, signal.SIGKILL)
        self._reap()


def _dispatch_table(*parts: Handlers) -> Handlers:
    """The driver's handlers and its helpers', one per event type (two would be a bug)."""
    table: Handlers = {}
    for part in parts:
        for kind, handler in part.items():
            if kind in table:
                raise ValueError(f"two handlers for {kind.__name__}")
            table[kind] = handler
    return table

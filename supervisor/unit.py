"""The supervisor's policy: start every service, watch them, stop them all as one unit.

Exit rules (documented in the README):
- a service exits on its own  -> stop the others, exit with its code (128+N for signal N)
- SIGTERM / SIGINT            -> graceful drain of every service, exit 0
- a second SIGINT             -> SIGKILL everything now, exit 130
- start-up timeout            -> stop everything, exit 3
- liveness failures           -> stop everything (the hung one too), exit 4
- a service cannot be started -> exit 127
- the MPS daemon will not start -> exit 5 (nothing else is started)

Signal handlers (`handle_<signal>`) only enqueue; everything else happens in `run`'s
loop, one event at a time, so the policy is plain sequential code.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any, Awaitable, Callable

from supervisor import report
from supervisor.child import ChildProcess, State
from supervisor.config import Config
from supervisor.control import ControlError, ControlServer, HealthServer
from supervisor.cpuquota import ThrottleWindow
from supervisor.gpu import GpuFacts
from supervisor.mps import MpsDaemon, MpsError
from supervisor.logs import LineSplitter, LogSink
from supervisor.oslayer import OsLayer, exit_code_of
from supervisor.plan import Plan
from supervisor.probe import ProbeResult, http_get

EXIT_STARTUP_TIMEOUT = 3
EXIT_LIVENESS = 4
EXIT_SPAWN_FAILED = 127
EXIT_KILLED_BY_SECOND_SIGINT = 130
EXIT_CONTROL_FAILED = 1
EXIT_MPS_FAILED = 5
THROTTLE_SAMPLE_S = 10.0

Prober = Callable[[str, int, str, float], Awaitable[ProbeResult]]
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


class Supervisor:
    def __init__(self, config: Config, plan: Plan, *, os_layer: OsLayer | None = None,
                 log: LogSink | None = None, prober: Prober = http_get, gpu: GpuFacts | None = None):
        self.config = config
        self.settings = config.supervisor
        self.plan = plan
        self.os = os_layer or OsLayer()
        self.log = log or LogSink(self.settings.log_format)
        self.prober = prober
        self.children = [ChildProcess(p) for p in plan.services]
        self._by_pid: dict[int, ChildProcess] = {}
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.started_at = self.os.monotonic()
        self.all_ready_at: float | None = None
        self.stopping = False
        self.stop_reason = ""
        self.exit_code: int | None = None
        self.orphans_reaped = 0
        self._grace_timer: asyncio.TimerHandle | None = None
        self.gpu = gpu or GpuFacts(config.gpu.visible_devices)
        self.throttle = ThrottleWindow(plan.quota)
        self.mps = (MpsDaemon(plan.mps_dir, config.gpu.mps_start_timeout_s, log=self.log.info)
                    if plan.mps_dir else None)

    # ---- signal handlers: enqueue only -------------------------------------------------
    def handle_sigterm(self) -> None:
        self._events.put_nowait(("signal", signal.SIGTERM))

    def handle_sigint(self) -> None:
        self._events.put_nowait(("signal", signal.SIGINT))

    def handle_sigchld(self) -> None:
        self._events.put_nowait(("sigchld", None))

    # ---- main loop --------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        servers = self._servers()
        try:
            for server in servers:
                await server.start()
        except ControlError as exc:
            self.log.error(str(exc))
            for server in servers:
                await server.close()
            return EXIT_CONTROL_FAILED
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, getattr(self, f"handle_{sig.name.lower()}"))
        try:
            self.os.become_subreaper()
            for warning in self.plan.warnings:
                self.log.warning(warning)
            self._tasks.append(loop.create_task(self._sample_throttling()))
            if self.mps is not None:
                await self._start_mps()
            if not self.stopping:
                self._spawn_all(loop)
            if not self.stopping:
                self._tasks.append(loop.create_task(self._startup()))
            self._on_sigchld()  # a child may have died before the handler could see it
            while not (self.stopping and self._all_exited()):
                kind, arg = await self._events.get()
                self._dispatch(kind, arg)
            await self._drain_output()
        finally:
            for task in self._tasks:
                task.cancel()
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            self._kill_stragglers()
            for sig in HANDLED_SIGNALS:
                loop.remove_signal_handler(sig)
            for server in servers:
                await server.close()
            if self.mps is not None:
                await asyncio.to_thread(self.mps.stop)  # only once every service is gone
        code = self.exit_code if self.exit_code is not None else 0
        self.log.info(f"exit {code}: {self.stop_reason}")
        return code

    async def _start_mps(self) -> None:
        """Before any service: a daemon that will not start stops the unit with nothing started.
        A signal that arrives meanwhile waits in the queue and is handled after."""
        try:
            await asyncio.to_thread(self.mps.start)
        except MpsError as exc:
            self.log.error(f"MPS: {exc}")
            self.stopping = True
            self.exit_code = EXIT_MPS_FAILED
            self.stop_reason = f"MPS control daemon did not start: {exc}"

    def _servers(self) -> list:
        servers: list = [ControlServer(self.settings.control_socket, lambda: report.snapshot(self))]
        if self.settings.health_port:
            servers.append(HealthServer(self.settings.health_host, self.settings.health_port, {
                "/healthz": self._route_healthz,
                "/readyz": self._route_readyz,
                "/metrics": lambda: (200, "text/plain; version=0.0.4", report.metrics_text(self)),
            }))
        return servers

    def _route_healthz(self) -> tuple[int, str, str]:
        if self.stopping:
            return 503, "application/json", json.dumps({"status": "stopping", "reason": self.stop_reason})
        return 200, "application/json", json.dumps({"status": "ok"})

    def _route_readyz(self) -> tuple[int, str, str]:
        if report.all_ready(self):
            return 200, "application/json", json.dumps({"ready": True})
        return 503, "application/json", json.dumps({"ready": False, "not_ready": report.not_ready(self)})

    def _dispatch(self, kind: str, arg: Any) -> None:
        if kind == "sigchld":
            self._on_sigchld()
        elif kind == "signal":
            self._on_signal(arg)
        elif kind == "fail":
            code, reason = arg
            self._begin_stop(code, reason)
        elif kind == "grace":
            self._on_grace_expired()

    def _spawn_all(self, loop: asyncio.AbstractEventLoop) -> None:
        for child in self.children:
            try:
                spawned = self.os.spawn(child.plan.argv, child.plan.env)
            except OSError as exc:
                self._begin_stop(EXIT_SPAWN_FAILED,
                                 f"{child.name}: cannot start {child.plan.argv[0]!r}: {exc}")
                return
            child.pid = spawned.pid
            child.started_at = self.os.monotonic()
            child.state = State.STARTING
            self._by_pid[spawned.pid] = child
            self._attach_output(loop, child, spawned.output_fd)
            self.log.info(f"{child.name}: started pid {child.pid} on {child.plan.host}:{child.plan.port}")

    def _attach_output(self, loop: asyncio.AbstractEventLoop, child: ChildProcess, fd: int) -> None:
        def on_line(text: str) -> None:
            child.tail.add(text)
            self.log.line(child.name, text)

        def on_eof() -> None:
            child.output_open = False
            self._events.put_nowait(("output_closed", child.name))

        child.output_open = True
        pipe = open(fd, "rb", buffering=0, closefd=True)
        self._tasks.append(loop.create_task(
            loop.connect_read_pipe(lambda: LineSplitter(on_line, on_eof), pipe)))

    # ---- events -----------------------------------------------------------------------
    def _on_sigchld(self) -> None:
        for pid, status in self.os.reap():
            child = self._by_pid.get(pid)
            if child is None:
                # An orphan re-parented to us (PID 1 or subreaper): reap it, nothing more.
                self.orphans_reaped += 1
                continue
            child.state = State.EXITED
            child.exit_code = exit_code_of(status)
            child.exited_at = self.os.monotonic()
            if self.stopping:
                how = " (it was told to stop)" if child.exit_code == 128 + signal.SIGTERM else ""
                self.log.info(f"{child.name}: exited with code {child.exit_code}{how}")
            else:
                self.log.error(f"{child.name}: exited with code {child.exit_code}; stopping every service")
                self._begin_stop(child.exit_code, f"{child.name} exited with code {child.exit_code}",
                                 culprit=child)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self.stopping:
            self.log.info(f"{name} received: draining every service (grace {self.settings.grace_s:g} s)")
            self._begin_stop(0, f"{name} received")
        elif sig == signal.SIGINT:
            self.log.warning("second SIGINT: killing every service now")
            self.exit_code = EXIT_KILLED_BY_SECOND_SIGINT
            self.stop_reason += "; second SIGINT"
            self._signal_all(signal.SIGKILL)

    def _on_grace_expired(self) -> None:
        for child in self.children:
            if child.alive:
                self.log.warning(f"{child.name}: still running {self.settings.grace_s:g} s after SIGTERM; SIGKILL")
                child.killed = True
        self._signal_all(signal.SIGKILL)

    def _begin_stop(self, code: int, reason: str, culprit: ChildProcess | None = None) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.exit_code = code
        self.stop_reason = reason
        for task in self._tasks:
            if getattr(task, "_onecard_probe", False):
                task.cancel()
        for child in self.children:
            if child.alive:
                child.state = State.STOPPING
        self._signal_all(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        self._grace_timer = loop.call_later(self.settings.grace_s, self._events.put_nowait, ("grace", None))

    def fail(self, code: int, reason: str) -> None:
        """For probe tasks: stop the unit with this code (enqueued like every other event)."""
        self._events.put_nowait(("fail", (code, reason)))

    def _signal_all(self, sig: int) -> None:
        # Whole groups, and also the groups of leaders that already exited: what a
        # service started must not outlive it.
        for child in self.children:
            if child.pid is not None:
                self.os.kill_group(child.pid, sig)

    def _all_exited(self) -> bool:
        return all(c.pid is None or c.state == State.EXITED for c in self.children)

    async def _drain_output(self) -> None:
        """Wait (bounded) for every child's last lines; a grandchild may hold the pipe."""
        deadline = self.os.monotonic() + 2.0
        while any(c.output_open for c in self.children):
            left = deadline - self.os.monotonic()
            if left <= 0:
                break
            try:
                kind, arg = await asyncio.wait_for(self._events.get(), left)
            except asyncio.TimeoutError:
                break
            if kind == "sigchld":
                self._on_sigchld()

    def _kill_stragglers(self) -> None:
        self._signal_all(signal.SIGKILL)
        self._on_sigchld()

    async def _sample_throttling(self) -> None:
        while True:
            self.throttle.sample()
            await asyncio.sleep(THROTTLE_SAMPLE_S)

    # ---- probes -----------------------------------------------------------------------
    def _probe_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        task._onecard_probe = True  # type: ignore[attr-defined]
        self._tasks.append(task)
        return task

    async def _startup(self) -> None:
        deadline = self.started_at + self.settings.startup_timeout_s
        pending = [c for c in self.children if c.alive]
        waits = [self._probe_task(self._until_ready(c, deadline)) for c in pending]
        results = await asyncio.gather(*waits, return_exceptions=True)
        if self.stopping:
            return
        late = [c for c, ok in zip(pending, results) if ok is not True]
        if late:
            details = []
            for c in late:
                tail = "\n".join(f"    {line}" for line in c.tail.lines()[-10:]) or "    (no output)"
                why = f" (last probe: {c.last_probe_error})" if c.last_probe_error else ""
                details.append(f"{c.name} not ready after {self.settings.startup_timeout_s:g} s{why}; "
                               f"its last lines:\n{tail}")
            for d in details:
                self.log.error(d)
            self.fail(EXIT_STARTUP_TIMEOUT, "start-up timeout: " + ", ".join(c.name for c in late))
            return
        self.all_ready_at = self.os.monotonic()
        self.log.info(f"all services ready in {self.all_ready_at - self.started_at:.2f} s")
        for c in self.children:
            self._probe_task(self._watch(c))

    async def _until_ready(self, child: ChildProcess, deadline: float) -> bool:
        s = self.settings
        while child.alive and not self.stopping:
            left = deadline - self.os.monotonic()
            if left <= 0:
                return False
            r = await self.prober(child.plan.host, child.plan.port, "/readyz",
                                  min(s.liveness_timeout_s, left))
            if r.ok:
                child.state = State.READY
                child.ready_at = self.os.monotonic()
                child.last_probe_error = ""
                self.log.info(f"{child.name}: ready after {child.ready_at - child.started_at:.2f} s")
                return True
            child.last_probe_error = r.error or f"/readyz answered {r.status}"
            await asyncio.sleep(min(s.readiness_period_s, max(0.0, deadline - self.os.monotonic())))
        return False

    async def _watch(self, child: ChildProcess) -> None:
        """Liveness, readiness and reported figures, every liveness period."""
        s = self.settings
        while child.alive and not self.stopping:
            await asyncio.sleep(s.liveness_period_s)
            health, ready, stats = await asyncio.gather(
                self.prober(child.plan.host, child.plan.port, "/healthz", s.liveness_timeout_s),
                self.prober(child.plan.host, child.plan.port, "/readyz", s.liveness_timeout_s),
                self.prober(child.plan.host, child.plan.port, "/stats", s.liveness_timeout_s),
            )
            if not child.alive or self.stopping:
                return
            report.sample_resources(child)
            report.absorb_stats(child, stats)
            if health.ok:
                child.liveness_misses = 0
            else:
                child.liveness_misses += 1
                child.last_probe_error = health.error or f"/healthz answered {health.status}"
                self.log.warning(f"{child.name}: liveness miss {child.liveness_misses}/"
                                 f"{s.liveness_failures}: {child.last_probe_error}")
                if child.liveness_misses >= s.liveness_failures:
                    self.fail(EXIT_LIVENESS, f"{child.name} failed {child.liveness_misses} liveness "
                                             f"probes in a row ({child.last_probe_error})")
                    return
            if child.state in (State.READY, State.NOT_READY):
                child.state = State.READY if ready.ok else State.NOT_READY

"""The supervisor's two ways in, seen from the driver: the control socket (status, stop)
and the probe port (/healthz, /readyz, /metrics), opened before anything starts, and the
control socket created again when someone deletes it. The servers themselves (servers/)
know nothing of the driver: they call the routes given here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from common import http1
from supervisor.driver import report
from supervisor.driver.events import Handlers, StopRequested
from supervisor.driver.port import DriverPort
from supervisor.driver.sampler import Sample, Sampler
from supervisor.policy.exit_codes import EXIT_CONTROL_FAILED, EXIT_SETUP
from supervisor.servers.control_socket import ControlError, ControlServer, prepare_run_dir
from supervisor.servers.probe_port import ProbePortError, ProbePortServer

# One status document serves every caller for this long: a crowd of `onecard status` calls
# costs one encoding, not one each.
STATUS_CACHE_S = 0.1
# A status call waits at most this long for a fresh sample (the sampler thread may be slow
# under load); else it gets the last one, with its age in sampled_s_ago.
FRESH_SAMPLE_WAIT_S = 0.1
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

View = Callable[[Sample | None], report.UnitView]


@dataclass(frozen=True)
class ControlSocketGone:
    """Someone deleted our control socket's file (seen by the sampler thread)."""


class Endpoints:
    def __init__(self, port: DriverPort, run_dir: str, sampler: Sampler, view: View):
        self.port = port
        self.run_dir = run_dir
        self.sampler = sampler
        self.view = view
        self.control: ControlServer | None = None
        self.probe_port: ProbePortServer | None = None
        self._recreating = False
        self._status: tuple[float, bytes] | None = None  # (when, the encoded status document)

    def handlers(self) -> Handlers:
        return {ControlSocketGone: self._on_control_socket_gone}

    async def open(self) -> int | None:
        """None when both are open, else the exit code (nothing was started)."""
        port, settings = self.port, self.port.settings
        self.control = ControlServer(settings, self._control_command)
        if settings.health_port:
            self.probe_port = ProbePortServer(settings, {
                "/healthz": self._route_healthz, "/readyz": self._route_readyz, "/metrics": self._route_metrics,
            }, on_refused=self._probe_refused)
        try:
            await asyncio.to_thread(prepare_run_dir, self.run_dir)
            await self.control.start()
            if self.probe_port is not None:
                await self.probe_port.start()
        except (ControlError, ProbePortError, OSError) as exc:
            port.log.error(str(exc))
            await self.close()
            return EXIT_SETUP if isinstance(exc, ProbePortError) and exc.taken else EXIT_CONTROL_FAILED
        return None

    async def close(self) -> None:
        for server in (self.control, self.probe_port):
            if server is not None:
                await server.close()

    def probe_refused(self) -> int:
        return self.probe_port.refused if self.probe_port else 0

    # ---- the control socket ---------------------------------------------------------------
    async def _control_command(self, cmd: str) -> bytes:
        port = self.port
        if cmd == "stop":
            port.post(StopRequested())
            return json.dumps({"stopping": True, "pid": port.system.getpid()}).encode()
        now = port.clock.now()
        if self._status is not None and now - self._status[0] <= STATUS_CACHE_S:
            return self._status[1]
        sample = await self.sampler.fresh(max_age_s=1.0, timeout_s=FRESH_SAMPLE_WAIT_S)
        data = json.dumps(report.snapshot(self.view(sample))).encode()
        self._status = (port.clock.now(), data)
        return data

    def watch_control_socket(self) -> None:
        """In the sampler thread: a deleted control socket is created again."""
        if self.control is not None and not self._recreating and self.control.missing():
            self.port.post_from_thread(ControlSocketGone())

    def _on_control_socket_gone(self, _: ControlSocketGone) -> None:
        if not self._recreating:
            self._recreating = True
            self.port.start_task(self._recreate_control())

    async def _recreate_control(self) -> None:
        port = self.port
        try:
            if self.control is not None and not port.stopping:
                await self.control.recreate()
                port.log.warning(f"control socket {self.control.path} was removed; created it again")
        except (ControlError, OSError) as exc:
            port.log.error(f"control socket {port.settings.control_socket} was removed and cannot be "
                           f"created again: {exc}")
        finally:
            self._recreating = False

    # ---- the probe port -------------------------------------------------------------------
    def _route_healthz(self) -> http1.Answer:
        if self.port.stopping:
            return http1.json_answer(503, {"status": "stopping", "reason": self.port.stop_reason})
        return http1.json_answer(200, {"status": "ok"})

    def _route_readyz(self) -> http1.Answer:
        view = self.view(None)
        if report.all_ready(view):
            return http1.json_answer(200, {"ready": True})
        return http1.json_answer(503, {"ready": False, "not_ready": report.not_ready(view)})

    def _route_metrics(self) -> http1.Answer:
        return http1.Answer(200, METRICS_TYPE, report.metrics_text(self.view(None)).encode())

    def _probe_refused(self, total: int) -> None:
        self.port.log_once("probe-refused", "warning",
                           f"probe port: {total} connections closed early so far (the longest idle, to make "
                           f"room: over {self.probe_port.max_clients if self.probe_port else 0} open at the same "
                           f"time)")

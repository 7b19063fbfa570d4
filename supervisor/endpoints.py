"""The supervisor's two ways in, seen from the supervisor: the control socket (status,
stop) and the probe port (/healthz, /readyz, /metrics), opened before anything starts,
and the control socket created again when someone deletes it.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from supervisor import report
from supervisor.control import ControlError, ControlServer, HealthServer, PortTaken, prepare_run_dir
from supervisor.lifecycle import EXIT_CONTROL_FAILED, EXIT_SETUP

if TYPE_CHECKING:  # typing only: the driver owns the endpoints, not the other way round
    from supervisor.unit import Supervisor


class Endpoints:
    def __init__(self, sup: "Supervisor"):
        self.sup = sup
        self.control: ControlServer | None = None
        self.health: HealthServer | None = None
        self._recreating = False

    async def open(self) -> int | None:
        """None when both are open, else the exit code (nothing was started)."""
        sup, s = self.sup, self.sup.settings
        self.control = ControlServer(s.control_socket, self._control_command)
        if s.health_port:
            self.health = HealthServer(s.health_host, s.health_port, {
                "/healthz": self._route_healthz, "/readyz": self._route_readyz,
                "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8",
                                     report.metrics_text(sup.view()))}, on_refused=self._probe_refused)
        try:
            await asyncio.to_thread(prepare_run_dir, sup.plan.run_dir)
            await self.control.start()
            if self.health is not None:
                await self.health.start()
        except (ControlError, OSError) as exc:
            sup.log.error(str(exc))
            await self.close()
            return EXIT_SETUP if isinstance(exc, PortTaken) else EXIT_CONTROL_FAILED
        return None

    async def close(self) -> None:
        for server in (self.control, self.health):
            if server is not None:
                await server.close()

    def probe_refused(self) -> int:
        return self.health.refused if self.health else 0

    def on_control_socket_gone(self) -> None:
        if not self._recreating:
            self._recreating = True
            self.sup.spawn_task(self._recreate_control())

    async def _control_command(self, cmd: str) -> dict[str, Any]:
        if cmd == "stop":
            self.sup.put("stop_request")
            return {"stopping": True, "pid": self.sup.os.getpid()}
        sample = await self.sup.sampler.fresh(max_age_s=1.0, timeout_s=0.5)
        return report.snapshot(self.sup.view(sample))

    def _route_healthz(self) -> tuple[int, str, str]:
        if self.sup.unit.stopping:
            return 503, "application/json", json.dumps({"status": "stopping", "reason": self.sup.unit.reason})
        return 200, "application/json", json.dumps({"status": "ok"})

    def _route_readyz(self) -> tuple[int, str, str]:
        v = self.sup.view()
        if report.all_ready(v):
            return 200, "application/json", json.dumps({"ready": True})
        return 503, "application/json", json.dumps({"ready": False, "not_ready": report.not_ready(v)})

    def _probe_refused(self, total: int) -> None:
        self.sup.log_once("probe-refused", "warning",
                          f"probe port: {total} connections closed at once so far (over "
                          f"{self.health.max_clients if self.health else 0} open at the same time)")

    def watch_control_socket(self) -> None:
        """In the sampler thread: a deleted control socket is created again."""
        loop = self.sup.loop
        if self.control is not None and not self._recreating and self.control.missing() and loop is not None:
            loop.call_soon_threadsafe(self.sup.put, "control_socket_gone")

    async def _recreate_control(self) -> None:
        try:
            if self.control is not None and not self.sup.unit.stopping:
                await self.control.recreate()
                self.sup.log.warning(f"control socket {self.control.path} was removed; created it again")
        except (ControlError, OSError) as exc:
            self.sup.log.error(f"control socket {self.sup.settings.control_socket} was removed and cannot be "
                               f"created again: {exc}")
        finally:
            self._recreating = False

"""The supervisor's two ways in, seen from the supervisor: the control socket (status,
stop) and the probe port (/healthz, /readyz, /metrics), opened before anything starts,
and the control socket created again when someone deletes it.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from supervisor import report
from supervisor.control import ControlError, ControlServer, prepare_run_dir
from supervisor.lifecycle import EXIT_CONTROL_FAILED, EXIT_SETUP
from supervisor.probeport import HealthServer, ProbePortError

# One status document serves every caller for this long: a crowd of `onecard status` calls
# costs one encoding, not one each.
STATUS_CACHE_S = 0.1
# A status call waits at most this long for a fresh sample (the sampler thread may be slow
# under load); else it gets the last one, with its age in sampled_s_ago.
FRESH_SAMPLE_WAIT_S = 0.1

if TYPE_CHECKING:  # typing only: the driver owns the endpoints, not the other way round
    from supervisor.unit import Supervisor


class Endpoints:
    def __init__(self, sup: "Supervisor"):
        self.sup = sup
        self.control: ControlServer | None = None
        self.health: HealthServer | None = None
        self._recreating = False
        self._status: tuple[float, bytes] | None = None  # (when, the encoded status document)

    async def open(self) -> int | None:
        """None when both are open, else the exit code (nothing was started)."""
        sup, s = self.sup, self.sup.settings
        self.control = ControlServer(s.control_socket, self._control_command, s.control_max_clients,
                                     s.control_idle_timeout_s)
        if s.health_port:
            self.health = HealthServer(s.health_host, s.health_port, {
                "/healthz": self._route_healthz, "/readyz": self._route_readyz,
                "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8",
                                     report.metrics_text(sup.view()))}, on_refused=self._probe_refused,
                max_clients=s.health_max_clients, idle_timeout_s=s.health_idle_timeout_s)
        try:
            await asyncio.to_thread(prepare_run_dir, sup.plan.run_dir)
            await self.control.start()
            if self.health is not None:
                await self.health.start()
        except (ControlError, ProbePortError, OSError) as exc:
            sup.log.error(str(exc))
            await self.close()
            return EXIT_SETUP if isinstance(exc, ProbePortError) and exc.taken else EXIT_CONTROL_FAILED
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

    async def _control_command(self, cmd: str) -> bytes:
        if cmd == "stop":
            self.sup.put("stop_request")
            return json.dumps({"stopping": True, "pid": self.sup.os.getpid()}).encode()
        now = self.sup.clock.now()
        if self._status is not None and now - self._status[0] <= STATUS_CACHE_S:
            return self._status[1]
        sample = await self.sup.sampler.fresh(max_age_s=1.0, timeout_s=FRESH_SAMPLE_WAIT_S)
        data = json.dumps(report.snapshot(self.sup.view(sample))).encode()
        self._status = (self.sup.clock.now(), data)
        return data

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
                          f"probe port: {total} connections closed early so far (the longest idle, to make room: "
                          f"over {self.health.max_clients if self.health else 0} open at the same time)")

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

"""The README's main command: the supervisor with configs/default.toml and the real services."""

from __future__ import annotations

import signal
import time

import httpx

from tests.harness import ROOT, SupervisorRun, free_port
from tests.images import astronaut, encode


class DefaultConfigRun(SupervisorRun):
    """configs/default.toml as shipped, with ports and socket moved out of the way."""

    def __init__(self, tmp, **ports):
        super().__init__(tmp, {})
        self.config = ROOT / "configs" / "default.toml"
        self.ports = {name: free_port() for name in ("detect", "img2img")}
        self.extra_args = ["--set", f"supervisor.health_port={self.health_port}",
                           "--set", f'supervisor.health_host="127.0.0.1"',
                           "--set", f'supervisor.control_socket="{self.socket}"',
                           "--set", "supervisor.liveness_period_s=1"]
        for name, port in self.ports.items():
            self.extra_args += ["--set", f"services.{name}.port={port}"]


def test_default_config_serves_detect_and_status_shows_it(tmp_path):
    with DefaultConfigRun(tmp_path) as run:
        run.wait_ready(timeout=240)
        r = httpx.post(f"http://127.0.0.1:{run.ports['detect']}/api/v1/facedetect",
                       content=encode(astronaut()), headers={"content-type": "image/png"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["faces"]) == 1
        time.sleep(2.5)  # a liveness period: the supervisor reads /stats
        doc = run.status_doc()
        detect = next(s for s in doc["services"] if s["name"] == "detect")
        assert detect["state"] == "ready" and detect["served"] == 1
        assert detect["queue_depth"] == 0 and detect["latency_p50_ms"] > 0
        table = run.status().stdout
        assert "detect" in table and "ready" in table
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        assert not run.wait_no_leftovers()

"""The README's main command: the supervisor with configs/default.toml and the real services."""

from __future__ import annotations

import base64
import os
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
        self.ports = {name: free_port() for name in ("detect", "img2img", "jobs")}
        self.extra_args = ["--set", f"supervisor.health_port={self.health_port}",
                           "--set", 'supervisor.health_host="127.0.0.1"',
                           "--set", f'supervisor.control_socket="{self.socket}"',
                           "--set", "supervisor.liveness_period_s=1"]
        for name, port in self.ports.items():
            self.extra_args += ["--set", f"services.{name}.port={port}"]


def _both_work(run) -> None:
    img = encode(astronaut())
    r = httpx.post(f"http://127.0.0.1:{run.ports['detect']}/api/v1/facedetect",
                   content=img, headers={"content-type": "image/png"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["faces"]) == 1
    r = httpx.post(f"http://127.0.0.1:{run.ports['img2img']}/api/v1/img2img?style=5",
                   content=img, headers={"content-type": "image/png"}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and len(r.content) > 10_000


def _a_job_works(run) -> None:
    jobs = f"http://127.0.0.1:{run.ports['jobs']}"
    r = httpx.post(jobs + "/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect",
                                            "image": base64.b64encode(encode(astronaut())).decode()}, timeout=60)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    while (doc := httpx.get(jobs + r.headers["location"], timeout=10).json())["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, doc
        time.sleep(0.1)
    assert doc["state"] == "succeeded" and len(doc["result"]["faces"]) == 1


def test_default_config_serves_both_and_status_shows_them(tmp_path):
    with DefaultConfigRun(tmp_path) as run:
        run.wait_ready(timeout=240)
        _both_work(run)
        time.sleep(2.5)  # a liveness period: the supervisor reads /stats
        doc = run.status_doc()
        by_name = {s["name"]: s for s in doc["services"] if s["name"] != "jobs"}
        assert {s["name"] for s in doc["services"]} == {"detect", "img2img", "jobs"}
        assert set(by_name) == {"detect", "img2img"}
        for s in by_name.values():
            assert s["state"] == "ready" and s["served"] == 1
            assert s["queue_depth"] == 0 and s["latency_p50_ms"] > 0
            # the batching policy, what it chose and its learned cost curve, from the service's /stats
            b = s["batching"]
            assert b["policy"] == "auto" and b["batches"] == 1 and b["mean_batch_size"] == 1
            # a CPU model's curve may have no fixed part (b items cost b times one): its line starts at 0
            assert b["fixed_ms"] >= 0 and b["per_extra_item_ms"] >= 0 and b["fixed_ms"] + b["per_extra_item_ms"] > 0
            assert b["held_budget_bytes"] > 0
        table = run.status().stdout
        assert "detect" in table and "img2img" in table
        assert "batching img2img  auto, 1 calls of 1.00 items, waited " in table and " ms an item" in table
        _a_job_works(run)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        assert not run.wait_no_leftovers()


def test_killing_img2img_takes_the_unit_down_with_its_exit_code(tmp_path):
    with DefaultConfigRun(tmp_path) as run:
        run.wait_ready(timeout=240)
        _both_work(run)
        os.kill(run.child_pid("img2img"), signal.SIGKILL)
        assert run.wait_exit(30) == 128 + signal.SIGKILL
        assert "img2img: exited with code 137; stopping every service" in run.output()
        assert not run.wait_no_leftovers()

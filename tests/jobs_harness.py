"""Units for the jobs tests: each a jobs service plus its own model services, every one a
real `python -m services.runtime.serve` process on a free port. All of a unit's processes
start together; everything a test starts is SIGKILLed and reaped when it ends."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from tests.harness import ROOT, free_port
from tests.reaping import end_process_tree

JOBS_APP = "services.jobs.app:create_app"
TARGET_APP = "tests.children.jobs_target:create_app"
DETECT_APP = "services.detect.app:create_app"
IMG2IMG_APP = "services.img2img.app:create_app"
TERMINAL = ("succeeded", "failed", "cancelled")


class Proc:
    """One service process, started the way the supervisor starts it."""

    def __init__(self, name: str, app: str, settings: dict[str, Any], tmp: Path, env: dict | None = None):
        self.name, self.app, self.settings = name, app, settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}-{self.port}.log"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "ONECARD_SERVICE_APP": app, "ONECARD_SERVICE_NAME": name,
                    "ONECARD_SERVICE_HOST": "127.0.0.1", "ONECARD_SERVICE_PORT": str(self.port),
                    "ONECARD_SERVICE_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.env.pop("ONECARD_UNIT_SERVICES", None)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        self.env["ONECARD_SERVICE_CONFIG"] = json.dumps(self.settings)
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.serve"], cwd=ROOT, env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.name} not ready in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            end_process_tree(self.proc, timeout=10)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


class Restarter:
    """Starts a service again on its port whenever it dies, as a supervisor that restarts a
    crashed service would, until stopped (then it kills it)."""

    def __init__(self, proc: Proc, delay_s: float = 0.0):
        self.proc, self.restarts, self.delay_s = proc, 0, delay_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            if self.proc.proc is not None and self.proc.proc.poll() is not None:
                self.restarts += 1
                if self._stop.wait(self.delay_s):
                    return
                self.proc.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Unit:
    """A jobs service and the model services it feeds, as one GPU node would run them."""

    def __init__(self, tmp: Path, node: str, targets: dict[str, tuple[str, dict]],
                 target_settings: dict[str, dict] | None = None, **jobs_settings: Any):
        self.node = node
        self.targets = {name: Proc(name, app, settings, tmp) for name, (app, settings) in targets.items()}
        tables = {n: {"url": p.url, **(target_settings or {}).get(n, {})} for n, p in self.targets.items()}
        # the embedded queue's results in the test's own directory (a killed unit leaves them)
        queue = {"results_dir": str(tmp), **jobs_settings.pop("queue", {})}
        settings = {"node_name": node, "targets": tables, "queue": queue, **jobs_settings}
        self.jobs = Proc("jobs", JOBS_APP, settings, tmp)
        self.api = httpx.Client(base_url=self.jobs.url, timeout=30, trust_env=False)

    @property
    def procs(self) -> list[Proc]:
        return [*self.targets.values(), self.jobs]

    def start(self) -> Unit:
        for p in self.procs:
            p.start()
        return self

    def wait_ready(self, timeout: float = 120.0) -> Unit:
        for p in self.procs:
            p.wait_ready(timeout)
        return self

    def kill(self) -> None:
        """SIGKILL every process of the unit, as when its node dies: the jobs process first,
        so that it never sees its services die (which it would rightly take as a crash)."""
        for p in (self.jobs, *self.targets.values()):
            p.kill()

    def stop(self) -> None:
        self.kill()
        self.api.close()

    # ---- the jobs API -------------------------------------------------------------
    def submit(self, service: str, route: str, expect: int = 202, headers: dict | None = None, **fields) -> dict:
        r = self.api.post("/v1/jobs", json={"service": service, "route": route, **fields}, headers=headers or {})
        assert r.status_code == expect, r.text
        return r.json()

    def job(self, job_id: str, **params) -> dict:
        r = self.api.get(f"/v1/jobs/{job_id}", params=params)
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, job_id: str, states: Iterable[str] = TERMINAL, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            r = self.api.get(f"/v1/jobs/{job_id}", params={"result": "false"})
            if r.status_code == 200:
                last = r.json()
                if last["state"] in states:
                    return self.job(job_id) if last["state"] == "succeeded" else last
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} not in {list(states)} within {timeout} s: {last}\n{self.jobs.output()}")

    def stats(self) -> dict:
        return self.api.get("/stats").json()

    def calls(self, target: str) -> dict:
        return httpx.get(self.targets[target].url + "/calls", timeout=10).json()


def start_units(*units: Unit, timeout: float = 120.0) -> None:
    for u in units:
        u.start()
    for u in units:
        u.wait_ready(timeout)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def error_of(r: httpx.Response) -> dict:
    """The JSON error envelope, asserted present: never a bare 500 or a text body."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    doc = r.json()
    assert set(doc) == {"error"} and isinstance(doc["error"]["message"], str), doc
    return doc["error"]


def idempotency_rules(u: Unit, key: str, work: str = "/api/v1/work", scripted: str = "scripted/scripted/m1") -> None:
    """An Idempotency-Key replays its job, and is refused (422) for another service or body."""
    h = {"Idempotency-Key": key}
    first = u.submit("scripted", work, headers=h, params={"tag": "idem"})
    again = u.api.post("/v1/jobs", json={"service": "scripted", "route": work, "params": {"tag": "idem"}}, headers=h)
    assert again.status_code == 202 and again.json()["id"] == first["id"]
    assert again.headers["idempotent-replayed"] == "true"
    for other in ({"service": "bare", "route": work, "params": {"tag": "idem"}},            # another service
                  {"service": "scripted", "route": work, "params": {"tag": "idem2"}},       # another body
                  {"service": "scripted", "route": work, "model": scripted, "params": {"tag": "idem", "x": 1}}):
        r = u.api.post("/v1/jobs", json=other, headers=h)
        assert r.status_code == 422, (other, r.text)
        err = error_of(r)
        assert err["code"] == "idempotency_key_reused" and first["id"] in err["message"], err

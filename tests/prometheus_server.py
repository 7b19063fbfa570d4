"""A real Prometheus server (and promtool) for the tests: on a free port, in a temporary
directory, scraping the targets a test names every second, stopped by the test that
started it, even when the test fails.

The binaries are ``$ONECARD_TEST_PROMETHEUS`` and ``$ONECARD_TEST_PROMTOOL``, else
``prometheus`` and ``promtool`` on the PATH (Debian's ``prometheus`` package; ./dev.sh
installs it). A missing binary fails the test: these tests never pass by not running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.harness import free_port

# Every figure a test waits for needs a scrape and an evaluation: both every second.
INTERVAL = "1s"


def binary(name: str) -> str:
    env = f"ONECARD_TEST_{name.upper()}"
    if os.environ.get(env):
        path = os.environ[env]
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            pytest.fail(f"{env}={path} is not an executable file")
        return path
    path = shutil.which(name) \
        or next((p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.access(p, os.X_OK)), None)
    if not path:
        pytest.fail(f"{name} not found: ./dev.sh installs Debian's prometheus package (apt-get install "
                    f"prometheus), or set {env} to a {name} binary")
    return path


def rules_without_for(rules: Path, tmp: Path) -> Path:
    """A copy of a rules file with every `for:` at 0 s: an end-to-end test checks the
    expressions against a real unit without waiting minutes (promtool's unit tests cover
    the durations)."""
    doc = yaml.safe_load(rules.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = tmp / f"{rules.stem}-for-0s.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def promtool(*args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], input=input, capture_output=True, text=True,
                          timeout=timeout)


class PrometheusServer:
    """`targets`: {job name: ["host:port", ...]}; `rule_files`: rules to evaluate every second."""

    def __init__(self, tmp: Path, targets: dict[str, list[str]], rule_files: list[Path] | None = None):
        self.dir = tmp / f"prometheus-{os.getpid()}-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": [str(p) for p in rule_files or []],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(hosts)}]}
                               for job, hosts in targets.items()],
        }))
        self.log_path = self.dir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        # flags that Prometheus 2.x and 3.x both take
        args = [binary("prometheus"), f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"prometheus not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None:
            self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the HTTP API --------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        doc = r.json()
        if doc.get("status") != "success":
            raise AssertionError(f"{path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's samples: [{"metric": {...}, "value": float}, ...]."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": float(data["result"][1])}]
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def alerts(self) -> list[dict]:
        """Active alerts (pending or firing)."""
        return self.api("alerts")["alerts"]

    def targets_up(self) -> dict[str, str]:
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 30.0, period: float = 0.25):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(period)
        raise AssertionError(f"{what}: not reached in {timeout} s (last: {last!r})\n{self.log()[-2000:]}")

    def wait_alert(self, name: str, timeout: float = 30.0, **labels: str) -> dict:
        def active():
            return next((a for a in self.alerts() if a["labels"].get("alertname") == name
                         and all(a["labels"].get(k) == v for k, v in labels.items())), None)
        return self.wait_for(f"alert {name} {labels} active", active, timeout=timeout)

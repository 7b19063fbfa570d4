"""The Grafana dashboard and the alert rules against a real Prometheus (Debian's binary)
scraping a real unit: `onecard run` with configs/default.toml (the real detect, img2img and
jobs services) and a stand-in NVML that shows a 16 GiB card.

Under load, every query of every panel returns data. Then the unit is made to fail the ways
the alerts name, and the matching alert becomes active (the rules as shipped, only their
`for:` set to 0 s so that the test does not wait minutes): a service whose queue is full
answers 503, a stopped service is not ready, a killed service takes the unit down.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.harness import ROOT, SupervisorRun, free_port
from tests.images import small_png
from tests.prometheus_server import PrometheusServer, rules_without_for

DASHBOARD = ROOT / "deploy" / "grafana" / "onecard.json"
RULES = ROOT / "deploy" / "prometheus" / "onecard-rules.yaml"  # `for:` set to 0 s here
FAKE_NVML = ROOT / "tests" / "children" / "fake_nvml"
DETECT_MAX_QUEUE = 4
# Grafana's $__rate_interval for a 1 s scrape is 4 s; a wider window keeps a quiet second of
# the load generator from emptying a rate
RATE_INTERVAL = "15s"
PNG = {"content-type": "image/png"}


class DefaultUnit(SupervisorRun):
    """configs/default.toml as shipped; ports and control socket moved out of the way, a
    small detect queue (the queue-full alert), and liveness misses tolerated long enough for
    a stopped service to be seen not ready before the supervisor gives up on it."""

    def __init__(self, tmp: Path):
        super().__init__(tmp, {}, env={"PYTHONPATH": f"{FAKE_NVML}:{ROOT}", "FAKE_NVML": "16"})
        self.config = ROOT / "configs" / "default.toml"
        self.ports = {name: free_port() for name in ("detect", "img2img", "jobs")}
        self.extra_args = ["--set", f"supervisor.health_port={self.health_port}",
                           "--set", 'supervisor.health_host="127.0.0.1"',
                           "--set", f'supervisor.control_socket="{self.socket}"',
                           "--set", "supervisor.liveness_period_s=1", "--set", "supervisor.liveness_failures=60",
                           "--set", f"services.detect.settings.max_queue={DETECT_MAX_QUEUE}"]
        for name, port in self.ports.items():
            self.extra_args += ["--set", f"services.{name}.port={port}"]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def targets(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in (self.health_port, *self.ports.values())]


class Load:
    """Bounded load on every route the dashboard shows, until stopped (or 5 minutes)."""

    def __init__(self, run: DefaultUnit):
        self.run = run
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.pool = ThreadPoolExecutor(4)
        self.futures = []

    def _loop(self, name, call):
        deadline = time.monotonic() + 300
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set() and time.monotonic() < deadline:
                try:
                    status = call(client)
                except httpx.HTTPError:
                    status = "error"
                key = f"{name} {status}"
                self.counts[key] = self.counts.get(key, 0) + 1
                self.stop.wait(0.05)

    def __enter__(self):
        png = small_png()
        # jobs for img2img only: the jobs service runs several at once, and detect's queue is
        # kept small for the queue-full alert (its one client here never fills it)
        job = {"service": "img2img", "route": "/api/v1/img2img", "image": base64.b64encode(png).decode()}
        r = self.run

        def detect(c):
            return c.post(r.url("detect") + "/api/v1/facedetect", content=png, headers=PNG).status_code

        def img2img(c):
            return c.post(r.url("img2img") + "/api/v1/img2img?style=3", content=png, headers=PNG).status_code

        def mixed(c):  # what clients get wrong, and the jobs API
            codes = [c.post(r.url("detect") + "/api/v1/facedetect", content=b"junk", headers=PNG).status_code,
                     c.get(r.url("img2img") + "/info").status_code,
                     c.post(r.url("jobs") + "/v1/jobs", json=job).status_code]
            self.stop.wait(0.5)
            return ",".join(map(str, codes))

        self.futures = [self.pool.submit(self._loop, n, f)
                        for n, f in (("detect", detect), ("img2img", img2img), ("mixed", mixed))]
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for f in self.futures:
            f.result(timeout=120)
        self.pool.shutdown()


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observed")
    with DefaultUnit(tmp) as run:
        run.wait_ready(timeout=240)
        with PrometheusServer(tmp, {"onecard": run.targets()}, rule_files=[rules_without_for(RULES, tmp)]) as prom:
            prom.wait_for("every target scraped", lambda: set(prom.targets_up().values()) == {"up"})
            yield run, prom


def dashboard_queries() -> list[tuple[str, str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def grafana(expr: str, unit: str = ".*", service: str = ".*") -> str:
    """The query as Grafana sends it: its variables replaced (All is the allValue `.*`; a
    chosen value of a multi-value variable arrives regex-escaped with doubled backslashes)."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$unit", unit).replace("$service", service)
            .replace("${datasource}", ""))


def settled(prom: PrometheusServer, expr: str, timeout: float = 10.0) -> list[dict]:
    """The query's samples, asked again for a while when empty: a scrape that ran past its
    1 s timeout on a busy machine marks the target's series stale until the next one."""
    deadline = time.monotonic() + timeout
    while not (got := prom.query(expr)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


def by(samples: list[dict], *labels: str) -> dict[tuple, float]:
    return {tuple(s["metric"].get(k, "") for k in labels): s["value"] for s in samples}


def test_every_panel_shows_the_unit_under_load(unit):
    run, prom = unit
    queries = dashboard_queries()
    assert len(queries) >= 40
    with Load(run) as load:
        def seen():  # every kind of traffic is in a rate window
            got = by(prom.query('sum by (instance, route) (rate(onecard_requests_total[15s]))'), "route")
            jobs = prom.query('sum(rate(onecard_jobs_total{state="succeeded"}[15s])) > 0')
            return {("/api/v1/facedetect",), ("/api/v1/img2img",)} <= {k for k, v in got.items() if v > 0} and jobs
        prom.wait_for("the load in Prometheus", seen, timeout=120)
        time.sleep(3)
        results = {(title, ref): settled(prom, grafana(expr)) for title, ref, expr in queries}
        units = [grafana(e) for t, _, e in queries if t == "Units"]  # up, ready, down
        prom.wait_for("units: 1 up, 1 ready, 0 down",
                      lambda: [s["value"] for e in units for s in prom.query(e)] == [1, 1, 0], timeout=30)
    empty = [(title, ref, expr) for title, ref, expr in queries if not results[(title, ref)]]
    assert empty == [], "panels without data:\n" + "\n".join(f"{t} [{r}]: {e}" for t, r, e in empty)
    assert not any(k.startswith("detect") and "503" in k for k in load.counts), load.counts

    # what the panels show is the unit's figures
    rate = by(results[("Request rate by service and route", "A")], "service", "route")
    assert rate[("detect", "/api/v1/facedetect")] > 0 and rate[("img2img", "/api/v1/img2img")] > 0
    assert rate[("img2img", "/info")] > 0 and all(route != "unmatched" for _, route in rate)
    statuses = by(results[("Answers by status", "A")], "service", "status")
    assert statuses[("detect", "415")] > 0 and statuses[("detect", "200")] > 0
    stages = by(results[("Mean time per stage (decode, queue, infer, encode)", "A")], "service", "stage")
    for service in ("detect", "img2img"):
        assert {s for (svc, s), v in stages.items() if svc == service and v == v} == \
            {"decode", "queue", "infer", "encode"}
    p99 = by(results[("Latency p99 by route", "A")], "service", "route")
    assert p99[("detect", "/api/v1/facedetect")] > 0
    mean_batch = by(results[("Items per model call", "C")], "service")
    assert mean_batch[("detect",)] >= 1
    assert by(results[("GPU memory of the card", "B")], "instance") == {(run.targets()[0],): 16 * 2**30}
    assert by(results[("Service ready (1) or not (0)", "A")], "service") == \
        {("detect",): 1, ("img2img",): 1, ("jobs",): 1}
    budgets = by(results[("Resident memory against the service budget", "B")], "service")
    assert budgets[("detect",)] > 0 and budgets[("img2img",)] > budgets[("detect",)]  # 0.5 and 0.2 of the limit
    assert sum(s["value"] for s in results[("Jobs submitted", "B")]) > 0
    assert {s["metric"]["stream"] for s in results[("Stream lag (not yet taken) per model", "A")]} == \
        {"detect/centerface/centerface", "img2img/style/multistyle26"}
    outcomes = by(results[("Attempts by outcome", "A")], "state")
    assert outcomes[("succeeded",)] > 0


def test_every_metric_the_alert_rules_name_is_served_by_the_unit(unit):
    """The promtool unit tests feed the rules series by name: a misspelt name passes there."""
    _, prom = unit
    names = set(re.findall(r"\b(onecard_[a-z0-9_]+|up)\b", RULES.read_text()))
    assert len(names) >= 12
    missing = sorted(n for n in names if not prom.query(f"count({n})"))
    assert missing == []


def test_the_unit_and_service_variables_narrow_every_panel(unit):
    run, prom = unit
    # the variables' own queries: a unit is the host of an instance, services come from build_info
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    instances = prom.api("label/instance/values", **{"match[]": "onecard_build_info"})
    regex = variables["unit"]["regex"].strip("/")
    assert {re.match(regex, i).group(1) for i in instances} == {"127.0.0.1"}
    services = prom.api("label/service/values", **{"match[]": 'onecard_build_info{instance=~"127.0.0.1:[0-9]+"}'})
    assert set(services) == {"detect", "img2img", "jobs"}  # every service of the unit names itself

    chosen = r"127\\.0\\.0\\.1"  # how Grafana escapes a chosen value of a multi-value variable
    for title, ref, expr in dashboard_queries():
        if "$service" in expr and "by (service" in expr:
            got = prom.query(grafana(expr, unit=chosen, service="detect"))
            assert {s["metric"].get("service") for s in got} <= {"detect"}, (title, ref)
        assert "$unit" in expr, (title, ref)
        if "vector(0)" not in expr:
            assert prom.query(grafana(expr, unit=r"10\\.9\\.9\\.9")) == [], (title, ref)


def test_alerts_become_active_when_the_unit_fails(unit):
    run, prom = unit
    tested = {"OnecardQueueFull", "OnecardServiceNotReady", "OnecardUnitDown"}
    # quiet on the healthy unit (a scrape that ran past its timeout may flap UnitDown for a second)
    prom.wait_for("no alert on the healthy unit",
                  lambda: not [a for a in prom.alerts() if a["labels"]["alertname"] in tested], timeout=30)

    # a flood beyond detect's queue: 503s
    png = small_png()
    stop = threading.Event()

    def flood():
        with httpx.Client(timeout=60) as c:
            for _ in range(400):
                if stop.is_set():
                    return
                c.post(f"{run.url('detect')}/api/v1/facedetect", content=png, headers=PNG)

    with ThreadPoolExecutor(3 * DETECT_MAX_QUEUE) as pool:
        futures = [pool.submit(flood) for _ in range(3 * DETECT_MAX_QUEUE)]
        try:
            alert = prom.wait_alert("OnecardQueueFull", timeout=60, service="detect")
        finally:
            stop.set()
            for f in futures:
                f.result(timeout=120)
    assert alert["labels"]["instance"] == f"127.0.0.1:{run.ports['detect']}"
    assert "refuses requests (503)" in alert["annotations"]["summary"]

    # a stopped service: its probes go unanswered, the supervisor marks it not ready
    pid = run.child_pid("img2img")
    os.kill(pid, signal.SIGSTOP)
    try:
        alert = prom.wait_alert("OnecardServiceNotReady", timeout=60, service="img2img")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert alert["labels"]["instance"] == run.targets()[0]
    run.wait_for("img2img ready again", lambda: run.service("img2img")["state"] == "ready", timeout=60)

    # a killed service: the unit stops, every one of its targets goes down
    os.kill(run.child_pid("detect"), signal.SIGKILL)
    assert run.wait_exit(60) == 128 + signal.SIGKILL
    down = {prom.wait_alert("OnecardUnitDown", timeout=60, instance=t)["labels"]["instance"] for t in run.targets()}
    assert down == set(run.targets())

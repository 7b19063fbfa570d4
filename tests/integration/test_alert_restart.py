"""A unit that stops and starts again on the same ports, scraped by a real Prometheus with
the shipped rules (`for:` at 0 s): down while it is gone (OnecardUnitDown), restarted once it
is back (OnecardUnitRestarted, from the reset of its services' CPU-seconds counters).

The services are the tests' stand-in app (no model to load, so a unit starts in a second);
the supervisor and its probe port's /metrics are the real ones."""

from __future__ import annotations

import signal

import httpx

from tests.harness import ROOT, SupervisorRun, fake_service, free_port
from tests.prometheus_server import PrometheusServer, rules_without_for

RULES = ROOT / "deploy" / "prometheus" / "onecard-rules.yaml"


def test_a_unit_that_goes_down_and_comes_back_raises_down_then_restarted(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    health_port = free_port()
    target = f"127.0.0.1:{health_port}"
    with PrometheusServer(tmp_path, {"onecard": [target]}, rule_files=[rules_without_for(RULES, tmp_path)]) as prom:
        first = tmp_path / "first"
        first.mkdir()
        with SupervisorRun(first, services, health_port=health_port) as run:
            run.wait_ready()
            # CPU time the new unit's counters start below: a second in a short-lived child
            # (the supervisor keeps what a reaped child used)
            r = httpx.get(f"http://127.0.0.1:{services['a']['port']}/burn?s=1", timeout=30)
            assert r.status_code == 200
            prom.wait_for("the burn scraped", lambda: prom.query(
                f'onecard_service_cpu_seconds_total{{instance="{target}", service="a"}} > 1'), timeout=30)
            assert not [a for a in prom.alerts() if a["labels"]["alertname"].startswith("OnecardUnit")]
            run.signal(signal.SIGTERM)
            assert run.wait_exit(30) == 0
        down = prom.wait_alert("OnecardUnitDown", instance=target)
        assert down["labels"]["severity"] == "critical"

        second = tmp_path / "second"
        second.mkdir()
        with SupervisorRun(second, services, health_port=health_port) as run:
            run.wait_ready()
            restarted = prom.wait_alert("OnecardUnitRestarted", instance=target)
            assert restarted["annotations"]["summary"] == f"onecard unit {target} restarted"
            prom.wait_for("the down alert resolved", lambda: not [
                a for a in prom.alerts() if a["labels"]["alertname"] == "OnecardUnitDown"])

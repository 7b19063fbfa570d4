"""deploy/grafana/onecard.json: what its generator writes, a dashboard Grafana imports as it
is (its data source a variable, ids and refIds unique, panels on the 24-column grid without
overlapping), and every subject the operators asked for on it. That each query returns data
from a real unit is tests/integration/test_dashboards_and_alerts.py."""

from __future__ import annotations

import importlib.util
import json

from tests.harness import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "onecard.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_file_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("make_dashboard", ROOT / "deploy" / "grafana" / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run: python3 deploy/grafana/make_dashboard.py"


def test_it_imports_anywhere_and_its_panels_tile_the_grid():
    doc = load()
    assert doc["uid"] == "onecard" and doc["schemaVersion"] >= 36 and "__inputs" not in doc
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("unit", "service"):
        v = variables[name]
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids, cells = set(), set()
    for p in doc["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["fieldConfig"]["defaults"]["unit"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs)
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip() and t["legendFormat"]
            assert t["expr"].count("(") == t["expr"].count(")")


def test_every_subject_has_its_panel():
    doc = load()
    exprs = "\n".join(t["expr"] for p in doc["panels"] for t in p.get("targets", []))
    for metric in (
            "onecard_requests_total", "onecard_request_duration_seconds_bucket", "onecard_stage_seconds",
            "onecard_batch_size_bucket", "onecard_batch_wait_seconds", "onecard_batch_cost_seconds",
            "onecard_queue_depth", "onecard_in_flight", "onecard_memory_held_bytes", "onecard_memory_budget_bytes",
            "onecard_memory_refused_total", "onecard_service_rss_bytes", "onecard_gpu_memory_used_bytes",
            "onecard_gpu_memory_total_bytes", "onecard_gpu_memory_bytes", "onecard_cpu_throttled_share_1m",
            "onecard_service_cpu_seconds_total", "onecard_cpu_quota_cpus", "onecard_service_exits_total",
            "onecard_ready", "onecard_service_state", "onecard_connections_refused_total",
            "onecard_requests_timed_out_total", "onecard_auth_failures_total", "onecard_jobs_total",
            "onecard_jobs_stream_lag", "onecard_jobs_pending", "onecard_jobs_dead_lettered_total",
            "onecard_jobs_backpressure_total", "onecard_jobs_stage_seconds_bucket"):
        assert metric in exprs, metric
    stages = next(p for p in doc["panels"] if p["title"].startswith("Mean time per stage"))
    assert "by (service, stage)" in stages["targets"][0]["expr"]
    latency = next(p for p in doc["panels"] if p["title"] == "Latency p99 by route")
    assert "by (service, route, le)" in latency["targets"][0]["expr"]

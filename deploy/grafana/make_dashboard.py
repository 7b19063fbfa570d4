"""Writes deploy/grafana/onecard.json, the Grafana dashboard for one onecard unit and for a
fleet of them (docs/operations.md, "Dashboard"). tests/unit/test_dashboard_file.py fails
when the file is not what this writes; tests/integration/test_dashboards.py runs every
query against a real Prometheus scraping a real unit.

    python3 deploy/grafana/make_dashboard.py

The queries assume nothing of the scrape configuration but Prometheus's own `job` and
`instance` labels: a service's name comes from its `onecard_build_info{service=...}`,
joined on (job, instance), and a unit is the host part of `instance` (the pod IP in
Kubernetes), which the `unit` variable extracts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parent / "onecard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
# every series of the chosen units (a target's instance is host:port)
U = 'instance=~"$unit:[0-9]+"'
# gives a service's series their service's name (the services' own metrics carry none)
SVC = 'on (job, instance) group_left (service) onecard_build_info{service=~"$service"}'
# requests for no route (a scanner's 404s) are not the service's traffic
MODEL = f'{U}, route!="unmatched"'


def per_service(expr: str, by: str = "service") -> str:
    return f"sum by ({by}) ({expr} * {SVC})"


def quantile(q: float, metric: str, by: str, selector: str = U) -> str:
    return f"histogram_quantile({q}, {per_service(f'rate({metric}_bucket{{{selector}}}[{RATE}])', f'{by}, le')})"


def share(numerator: str, selector: str) -> str:
    """numerator / all requests by service; 0 rather than nothing while the numerator is empty."""
    total = per_service(f"rate(onecard_requests_total{{{selector}}}[{RATE}])")
    return f"({per_service(f'rate(onecard_requests_total{{{numerator}}}[{RATE}])')} or 0 * {total}) / {total}"


ANSWERED = per_service(f"rate(onecard_requests_total{{{MODEL}}}[{RATE}])")
REFUSED = per_service(f'rate(onecard_requests_total{{{MODEL}, status="503"}}[{RATE}])')


def t(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend}


ROWS: list[tuple[str, list[dict]]] = [
    ("Units", [
        {"title": "Units", "type": "stat", "unit": "short", "w": 6,
         "description": "Units scraped now, ready now, and down (answered /metrics in the last hour, not now).",
         "targets": [t(f"count(onecard_ready{{{U}}})", "up"),
                     t(f"sum(onecard_ready{{{U}}})", "ready"),
                     t(f"count((up{{{U}}} == 0) and on (job, instance) max_over_time(onecard_ready[1h])) or vector(0)",
                       "down")]},
        {"title": "Unit ready (1) or not (0)", "unit": "short", "w": 6,
         "description": "onecard_ready: every service of the unit is ready (the supervisor's /readyz).",
         "targets": [t(f"max by (instance) (onecard_ready{{{U}}})", "{{instance}}")]},
        {"title": "Service ready (1) or not (0)", "unit": "short", "w": 6,
         "description": "The supervisor's view of each service (onecard_service_state{state=\"ready\"}).",
         "targets": [t(f'max by (instance, service) (onecard_service_state{{{U}, service=~"$service", state="ready"}})',
                       "{{instance}} {{service}}")]},
        {"title": "Restarts and exits", "unit": "short", "w": 6,
         "description": "Restarts in the last hour (the services' CPU-seconds counters started again: a new unit), "
                        "and service exits the supervisor saw (any exit stops the unit).",
         "targets": [t(f"max by (instance) (resets(onecard_service_cpu_seconds_total{{{U}}}[1h]))",
                       "{{instance}} restarts (1h)"),
                     t(f'sum by (instance, service) (onecard_service_exits_total{{{U}, service=~"$service"}})',
                       "{{instance}} {{service}} exits"),
                     t(f'max by (instance, service) (onecard_service_liveness_misses{{{U}, service=~"$service"}})',
                       "{{instance}} {{service}} liveness misses")]},
    ]),
    ("Requests", [
        {"title": "Request rate by service and route", "unit": "reqps",
         "targets": [t(per_service(f"rate(onecard_requests_total{{{MODEL}}}[{RATE}])", "service, route"),
                       "{{service}} {{route}}")]},
        {"title": "Answers by status", "unit": "reqps",
         "targets": [t(per_service(f"rate(onecard_requests_total{{{MODEL}}}[{RATE}])", "service, status"),
                       "{{service}} {{status}}")]},
        {"title": "Error ratio", "unit": "percentunit",
         "description": "Share of answers that were 5xx (503 queue full or memory busy, 504 past the deadline, "
                        "500 the model failed) and 4xx (the caller's fault).",
         "targets": [t(share(f'{MODEL}, status=~"5.."', MODEL), "{{service}} 5xx"),
                     t(share(f'{MODEL}, status=~"4.."', MODEL), "{{service}} 4xx")]},
        {"title": "Queue full (503) rate", "unit": "reqps",
         "targets": [t(f"{REFUSED} or 0 * {ANSWERED}", "{{service}}")]},
        {"title": "Latency p50 by route", "unit": "s",
         "description": "End to end, answered requests (503 refusals are immediate and left out).",
         "targets": [t(quantile(0.5, "onecard_request_duration_seconds", "service, route", f'{MODEL}, status!="503"'),
                       "{{service}} {{route}}")]},
        {"title": "Latency p99 by route", "unit": "s",
         "targets": [t(quantile(0.99, "onecard_request_duration_seconds", "service, route", f'{MODEL}, status!="503"'),
                       "{{service}} {{route}}"),
                     t(quantile(0.9, "onecard_request_duration_seconds", "service, route", f'{MODEL}, status!="503"'),
                       "{{service}} {{route}} p90")]},
        {"title": "Dropped before or during the model", "unit": "reqps",
         "description": "Requests given up by reason (client gone, deadline, out of memory).",
         "targets": [t(f"{per_service(f'rate(onecard_dropped_total{{{U}}}[{RATE}])', 'service, reason')} or 0 * "
                       f"{ANSWERED}", "{{service}} {{reason}}")]},
    ]),
    ("Pipeline stages", [
        {"title": "Mean time per stage (decode, queue, infer, encode)", "unit": "s", "stack": True,
         "targets": [t(f"{per_service(f'rate(onecard_stage_seconds_sum{{{U}}}[{RATE}])', 'service, stage')} / "
                       f"{per_service(f'rate(onecard_stage_seconds_count{{{U}}}[{RATE}])', 'service, stage')}",
                       "{{service}} {{stage}}")]},
        {"title": "Stage p99", "unit": "s",
         "targets": [t(quantile(0.99, "onecard_stage_seconds", "service, stage"), "{{service}} {{stage}}")]},
    ]),
    ("Batching", [
        {"title": "Items per model call", "unit": "short", "w": 8,
         "targets": [t(quantile(0.5, "onecard_batch_size", "service"), "{{service}} p50"),
                     t(quantile(0.99, "onecard_batch_size", "service"), "{{service}} p99"),
                     t(f"{per_service(f'rate(onecard_batch_size_sum{{{U}}}[{RATE}])')} / "
                       f"{per_service(f'rate(onecard_batch_size_count{{{U}}}[{RATE}])')}", "{{service}} mean")]},
        {"title": "Model calls per second", "unit": "ops", "w": 8,
         "targets": [t(per_service(f"rate(onecard_batch_size_count{{{U}}}[{RATE}])"), "{{service}}")]},
        {"title": "Batching wait", "unit": "s", "w": 8,
         "description": "How long the batch loop waited for more items before a call (onecard_batch_wait_seconds; "
                        "a CPU model never waits). The share is seconds waited per second.",
         "targets": [t(quantile(0.99, "onecard_batch_wait_seconds", "service"), "{{service}} p99"),
                     t(per_service(f"rate(onecard_batch_wait_seconds_sum{{{U}}}[{RATE}])"), "{{service}} share")]},
        {"title": "Learned cost of one model call by batch size", "unit": "s",
         "description": "onecard_batch_cost_seconds: the curve the batching policy decides from (measured at "
                        "warm-up, kept current from live calls; per unit of the warm-up item's work).",
         "targets": [t(f"max by (service, batch_size) (onecard_batch_cost_seconds{{{U}}} * {SVC})",
                       "{{service}} batch {{batch_size}}")]},
        {"title": "Queue depth and items on the model", "unit": "short",
         "targets": [t(per_service(f"onecard_queue_depth{{{U}}}"), "{{service}} queued"),
                     t(per_service(f"onecard_in_flight{{{U}}}"), "{{service}} on the model")]},
    ]),
    ("Memory", [
        {"title": "Held by admitted requests, against the budgets", "unit": "bytes", "w": 8,
         "targets": [t(per_service(f"onecard_memory_held_bytes{{{U}}}"), "{{service}} held"),
                     t(per_service(f'onecard_memory_budget_bytes{{{U}, budget="held"}}'), "{{service}} held budget"),
                     t(per_service(f'onecard_memory_budget_bytes{{{U}, budget="request"}}'),
                       "{{service}} one request")]},
        {"title": "Resident memory against the service budget", "unit": "bytes", "w": 8,
         "targets": [t(f'sum by (service) (onecard_service_rss_bytes{{{U}, service=~"$service"}})', "{{service}} RSS"),
                     t(per_service(f'onecard_memory_budget_bytes{{{U}, budget="service"}}'), "{{service}} budget"),
                     t(per_service(f'onecard_memory_budget_bytes{{{U}, budget="call"}}'), "{{service}} one call"),
                     t(f"sum(onecard_supervisor_rss_bytes{{{U}}})", "supervisor RSS")]},
        {"title": "Requests refused for memory (503 memory_busy)", "unit": "short", "w": 8,
         "targets": [t(per_service(f"increase(onecard_memory_refused_total{{{U}}}[{RATE}])"), "{{service}}")]},
    ]),
    ("GPU", [
        {"title": "GPU memory of the card", "unit": "bytes", "w": 8,
         "description": "Absent on a unit without a GPU (onecard_gpu_available 0).",
         "targets": [t(f"max by (instance) (onecard_gpu_memory_used_bytes{{{U}}})", "{{instance}} used"),
                     t(f"max by (instance) (onecard_gpu_memory_total_bytes{{{U}}})", "{{instance}} total")]},
        {"title": "GPU memory by service", "unit": "bytes", "w": 8,
         "description": "NVML's figure for the service's processes where the supervisor can match them, else what "
                        "the service reports; each service's budget is its gpu_memory_fraction of the card.",
         "targets": [t(f'max by (service) (onecard_service_gpu_memory_bytes{{{U}, service=~"$service"}}) or '
                       f"max by (service) (onecard_gpu_memory_bytes{{{U}}} * {SVC})", "{{service}}")]},
        {"title": "GPU utilization", "unit": "percent", "w": 8,
         "targets": [t(f"max by (instance) (onecard_gpu_utilization_percent{{{U}}})", "{{instance}}"),
                     t(f"max by (instance) (onecard_gpu_available{{{U}}})", "{{instance}} available")]},
    ]),
    ("CPU", [
        {"title": "CPU used by service, against the quota", "unit": "short",
         "targets": [t(f'sum by (service) (rate(onecard_service_cpu_seconds_total'
                       f'{{{U}, service=~"$service"}}[{RATE}]))',
                       "{{service}} cores"),
                     t(f"max by (instance) (onecard_cpu_quota_cpus{{{U}}})", "{{instance}} quota")]},
        {"title": "CPU throttling", "unit": "percentunit",
         "description": "Share of CFS periods throttled (a GPU service that is CPU-starved is slow).",
         "targets": [t(f"max by (instance) (onecard_cpu_throttled_share_1m{{{U}}})", "{{instance}} last minute"),
                     t(f"max by (instance) (rate(onecard_cpu_throttled_seconds_total{{{U}}}[{RATE}]))",
                       "{{instance}} throttled s/s")]},
    ]),
    ("Connections and auth", [
        {"title": "Connections refused and timed out", "unit": "ops", "w": 8,
         "targets": [t(per_service(f"rate(onecard_connections_refused_total{{{U}}}[{RATE}])"),
                       "{{service}} refused (max_connections)"),
                     t(per_service(f"rate(onecard_requests_timed_out_total{{{U}}}[{RATE}])"),
                       "{{service}} timed out (408)"),
                     t(per_service(f"rate(onecard_send_timeouts_total{{{U}}}[{RATE}])"), "{{service}} send timeouts"),
                     t(f"sum by (instance) (rate(onecard_probe_connections_refused_total{{{U}}}[{RATE}]))",
                       "{{instance}} probe port refused")]},
        {"title": "Malformed and oversized requests", "unit": "ops", "w": 8,
         "targets": [t(per_service(f"rate(onecard_headers_too_large_total{{{U}}}[{RATE}])"), "{{service}} 431"),
                     t(per_service(f"rate(onecard_bad_http_requests_total{{{U}}}[{RATE}])"), "{{service}} bad HTTP"),
                     t(per_service(f"rate(onecard_request_framing_too_large_total{{{U}}}[{RATE}])"),
                       "{{service}} framing 413"),
                     t(per_service(f"rate(onecard_pipelined_requests_refused_total{{{U}}}[{RATE}])"),
                       "{{service}} pipelined 429")]},
        {"title": "Auth failures", "unit": "ops", "w": 8,
         "targets": [t(per_service(f"rate(onecard_auth_failures_total{{{U}}}[{RATE}])"), "{{service}} 401"),
                     t(per_service(f"rate(onecard_auth_rate_limited_total{{{U}}}[{RATE}])"),
                       "{{service}} 429 (limiter)")]},
    ]),
    ("Jobs API", [
        {"title": "Jobs submitted", "unit": "ops", "w": 8,
         "targets": [t(f'sum by (instance) (rate(onecard_jobs_total{{{U}, state="submitted"}}[{RATE}]))',
                       "{{instance}}"),
                     t(f'sum(rate(onecard_jobs_total{{{U}, state="submitted"}}[{RATE}]))', "all units")]},
        {"title": "Attempts by outcome", "unit": "ops", "w": 8,
         "description": "What the units' consumers did with the jobs they ran (retried: the attempt failed and the "
                        "job went back; backpressure: the local service answered 503/429, not an attempt).",
         "targets": [t(f'sum by (state) (rate(onecard_jobs_total{{{U}, state!="submitted"}}[{RATE}]))', "{{state}}"),
                     t(f"sum(rate(onecard_jobs_backpressure_total{{{U}}}[{RATE}]))", "backpressure")]},
        {"title": "Job time by stage", "unit": "s", "w": 8,
         "targets": [t(f"histogram_quantile(0.5, sum by (stage, le) (rate(onecard_jobs_stage_seconds_bucket{{{U}}}"
                       f"[{RATE}])))", "{{stage}} p50"),
                     t(f"histogram_quantile(0.99, sum by (stage, le) (rate(onecard_jobs_stage_seconds_bucket{{{U}}}"
                       f"[{RATE}])))", "{{stage}} p99")]},
        {"title": "Stream lag (not yet taken) per model", "unit": "short", "w": 8,
         "description": "Every unit that consumes a stream reports the same figure: max by stream.",
         "targets": [t(f"max by (stream) (onecard_jobs_stream_lag{{{U}}})", "{{stream}}")]},
        {"title": "Pending (taken, not finished) per model", "unit": "short", "w": 8,
         "targets": [t(f"max by (stream) (onecard_jobs_pending{{{U}}})", "{{stream}}"),
                     t(f"sum by (instance, stream) (onecard_jobs_in_progress{{{U}}})",
                       "{{instance}} {{stream}} running here")]},
        {"title": "Dead letters per model", "unit": "short", "w": 8,
         "targets": [t(f"max by (stream) (onecard_jobs_dead_lettered_total{{{U}}})", "{{stream}} in all"),
                     t(f"max by (stream) (increase(onecard_jobs_dead_lettered_total{{{U}}}[1h]))",
                       "{{stream}} last hour")]},
    ]),
]


def panel(spec: dict, pid: int, x: int, y: int) -> dict:
    kind = spec.get("type", "timeseries")
    custom = {"stacking": {"mode": "normal" if spec.get("stack") else "none"}, "fillOpacity": 10,
              "showPoints": "never", "spanNulls": True} if kind == "timeseries" else {}
    out = {"id": pid, "type": kind, "title": spec["title"], "datasource": DS,
           "gridPos": {"h": 8, "w": spec.get("w", 12), "x": x, "y": y},
           "fieldConfig": {"defaults": {"unit": spec["unit"], "custom": custom}, "overrides": []},
           "options": ({"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else
                       {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "none", "textMode": "value_and_name"}),
           "targets": [{"datasource": DS, "refId": chr(ord("A") + i), "expr": q["expr"],
                        "legendFormat": q["legendFormat"], "range": True, "instant": False}
                       for i, q in enumerate(spec["targets"])]}
    if spec.get("description"):
        out["description"] = spec["description"]
    return out


def variables() -> list[dict]:
    def query_var(name: str, label: str, query: str, regex: str = "") -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"{name}-values"}, "definition": query, "regex": regex,
                "multi": True, "includeAll": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
                "refresh": 2, "sort": 1, "hide": 0, "options": []}
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        # a unit is the host of its targets' instance label: the supervisor's and every service's port
        query_var("unit", "Unit", "label_values(onecard_build_info, instance)", r"/^(.*):[0-9]+$/"),
        query_var("service", "Service", 'label_values(onecard_build_info{instance=~"$unit:[0-9]+"}, service)'),
    ]


def build() -> dict:
    panels, pid, y = [], 1, 0
    for title, specs in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y, x = pid + 1, y + 1, 0
        for spec in specs:
            w = spec.get("w", 12)
            if x + w > 24:
                x, y = 0, y + 8
            panels.append(panel(spec, pid, x, y))
            pid, x = pid + 1, x + w
        y += 8
    return {
        "title": "onecard", "uid": "onecard", "tags": ["onecard"], "editable": True, "graphTooltip": 1,
        "description": "onecard units: readiness and restarts, requests, stages, batching, memory, GPU, CPU, "
                       "connections, and the jobs API. Pick units and services above; All is the fleet.",
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "timepicker": {}, "timezone": "", "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        "links": [], "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}", file=sys.stderr)

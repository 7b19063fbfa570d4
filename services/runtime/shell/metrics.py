"""The metrics every service has: one Prometheus registry, requests and their latency by
route and status, the build, the HTTP edge's counters. A service part registers its own
figures on the same registry (the pipeline's: services.runtime.pipeline.metrics; the jobs
queue's: services.jobs.metrics), so /metrics is one exposition whatever the service."""

from __future__ import annotations

import importlib.metadata
import platform

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

REQUEST_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)
METRICS_TYPE = "text/plain; version=0.0.4"


def version() -> str:
    try:
        return importlib.metadata.version("onecard")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class _ConnectionCollector:
    """Counters the HTTP protocol keeps (refused, timed out, oversized headers)."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        for name, attr, text in (
                ("onecard_connections_refused", "refused", "Connections refused beyond max_connections."),
                ("onecard_requests_timed_out", "timed_out", "Requests not received within their deadline (408)."),
                ("onecard_headers_too_large", "headers_too_large", "Requests refused for oversized headers (431)."),
                ("onecard_bad_http_requests", "bad_requests", "Requests that were not valid HTTP (400).")):
            fam = CounterMetricFamily(name, text)
            fam.add_metric([], getattr(self.stats, attr))
            yield fam


class ShellMetrics:
    def __init__(self, service: str, connection_stats=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("onecard_requests", "Requests by route and status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("onecard_request_duration_seconds", "End-to-end request latency by route and status.",
                                 ["route", "status"], buckets=REQUEST_BUCKETS, registry=r)
        self.build = Gauge("onecard_build_info", "Build of this service (value 1).",
                           ["version", "service", "python"], registry=r)
        self.build.labels(version(), service, platform.python_version()).set(1)
        if connection_stats is not None:
            r.register(_ConnectionCollector(connection_stats))

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route, str(status)).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

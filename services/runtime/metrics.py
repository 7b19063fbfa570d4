"""Prometheus metrics of one service, and the short figures the supervisor reads on /stats."""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STAGE_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)


class ServiceMetrics:
    def __init__(self, service: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("onecard_requests", "Requests by route and status.",
                                ["route", "status"], registry=r)
        self.stage = Histogram("onecard_stage_seconds", "Time per request stage.", ["stage"],
                               buckets=STAGE_BUCKETS, registry=r)
        self.batch_size = Histogram("onecard_batch_size", "Requests per model call.",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.queue_depth = Gauge("onecard_queue_depth", "Requests waiting for the model.", registry=r)
        self.in_flight = Gauge("onecard_in_flight", "Requests on the model now.", registry=r)
        self.gpu_memory = Gauge("onecard_gpu_memory_bytes", "GPU memory this service holds (self-reported).",
                                registry=r)
        self.dropped = Counter("onecard_dropped", "Requests dropped before the model, by reason.",
                               ["reason"], registry=r)
        self._lat: collections.deque[float] = collections.deque(maxlen=2048)
        self._lock = threading.Lock()
        self.served = 0
        self.errors = 0

    def observe_request(self, route: str, status: int, seconds: float | None) -> None:
        self.requests.labels(route, str(status)).inc()
        if status < 400 and seconds is not None:
            with self._lock:
                self.served += 1
                self._lat.append(seconds)
        elif status >= 500:
            self.errors += 1

    def latency_percentiles(self) -> tuple[float | None, float | None]:
        with self._lock:
            data = sorted(self._lat)
        if not data:
            return None, None
        def q(p):
            return data[min(len(data) - 1, int(round(p * (len(data) - 1))))]
        return q(0.5), q(0.99)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

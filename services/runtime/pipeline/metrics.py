"""The pipeline's figures: per-stage times of model requests, batches, the cost model's
curves and budgets, the queue, drops; and the short figures the supervisor reads on
/stats (served, errors, p50, p99), which count model work only: a 1 ms progress poll is
not a served generation. Registered on the service's registry (the shell's)."""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

STAGE_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.stage = Histogram("onecard_stage_seconds", "Time per model request stage, by route.",
                               ["route", "stage"], buckets=STAGE_BUCKETS, registry=r)
        self.batch_size = Histogram("onecard_batch_size", "Items per model call.",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256), registry=r)
        self.batch_wait = Histogram("onecard_batch_wait_seconds",
                                    "Time the batch loop waited for more items before a model call (auto policy).",
                                    buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2), registry=r)
        self.batch_cost = Gauge("onecard_batch_cost_seconds",
                                "The learned time of one model call by batch size (per unit of the warm-up item's "
                                "work).",
                                ["batch_size"], registry=r)
        self.memory_budget = Gauge("onecard_memory_budget_bytes",
                                   "The service's memory budgets: service, call (one model call), held (admitted "
                                   "requests together), request (one request).", ["budget"], registry=r)
        self.memory_held = Gauge("onecard_memory_held_bytes", "Memory admitted requests hold now.", registry=r)
        self.memory_over_budget = Gauge("onecard_memory_over_budget",
                                        "1 while the service's resident memory is over its service budget.",
                                        registry=r)
        self._ledger = None  # the cost model's HeldMemory, once planned: its counts are read at each scrape
        r.register(_LedgerCounts(self))
        self.queue_depth = Gauge("onecard_queue_depth", "Admitted requests not yet on the model.", registry=r)
        self.in_flight = Gauge("onecard_in_flight", "Items on the model now.", registry=r)
        self.gpu_memory = Gauge("onecard_gpu_memory_bytes", "GPU memory this service holds (self-reported).",
                                registry=r)
        self.dry_run = Counter("onecard_dry_runs", "Dry runs (X-Onecard-Dry-Run: checked, never run) by route and "
                               "status; not in onecard_requests_total.", ["route", "status"], registry=r)
        self.dropped = Counter("onecard_dropped", "Requests dropped before or during the model, by reason.",
                               ["reason"], registry=r)
        self._lat: collections.deque[float] = collections.deque(maxlen=2048)
        self._lock = threading.Lock()
        self.served = 0
        self.errors = 0
        self.dry_runs = 0

    def observe_model_request(self, status: int, seconds: float) -> None:
        with self._lock:
            if status < 400:
                self.served += 1
                self._lat.append(seconds)
            elif status >= 500 and status not in (503, 504):
                self.errors += 1

    def observe_dry_run(self, route: str, status: int) -> None:
        self.dry_run.labels(route, str(status)).inc()
        with self._lock:
            self.dry_runs += 1

    def observe_cost(self, cost) -> None:
        """The cost model's figures (services.runtime.pipeline.cost.ServiceCost), at each scrape."""
        for size, ms in cost.curve.snapshot()["ms_by_batch_size"].items():
            self.batch_cost.labels(size).set(ms / 1000)
        budgets = cost.budgets
        if budgets is not None:
            for name, value in (("service", budgets.service_bytes), ("call", budgets.batch_bytes),
                                ("held", budgets.held_bytes), ("request", budgets.request_bytes)):
                self.memory_budget.labels(name).set(value)
        if cost.held is not None:
            self.memory_held.set(cost.held.used)
            self._ledger = cost.held

    def latency_percentiles(self) -> tuple[float | None, float | None]:
        with self._lock:
            data = sorted(self._lat)
        if not data:
            return None, None

        def q(p: float) -> float:
            return data[min(len(data) - 1, int(round(p * (len(data) - 1))))]
        return q(0.5), q(0.99)


class _LedgerCounts:
    """Counters the memory ledger keeps itself (requests that waited their turn for memory, and
    those refused at their deadline), exposed as Prometheus counters."""

    def __init__(self, metrics: PipelineMetrics):
        self.metrics = metrics

    def collect(self):
        ledger = self.metrics._ledger
        for name, attr, text in (
                ("onecard_memory_waited", "waited", "Requests that waited their turn for memory others held."),
                ("onecard_memory_refused", "refused", "Requests refused (503 memory_busy) because the memory they "
                                                      "needed was not handed back before their deadline.")):
            family = CounterMetricFamily(name, text)
            family.add_metric([], getattr(ledger, attr) if ledger is not None else 0)
            yield family

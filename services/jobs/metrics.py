"""The jobs service's figures: on the shell's registry (/metrics), and the short ones on /stats.

Stream figures (lag, pending, dead-lettered) belong to the queue, not to this process:
they are read from the backend at each scrape, for the streams this unit consumes.
"""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STAGE_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
STAGES = ("queued", "running")


class _QueueCollector:
    """What the queue backend reports at scrape time: write refusals by reason, and whether
    it takes writes now."""

    def __init__(self) -> None:
        self.refusals: dict[str, int] = {}
        self.refusing: str | None = None

    def collect(self):
        refusals = CounterMetricFamily("onecard_jobs_queue_write_refusals", "Writes the queue refused (Redis at "
                                       "its maxmemory, a read-only replica), by reason.", labels=["reason"])
        for reason, n in sorted(self.refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals
        writable = GaugeMetricFamily("onecard_jobs_queue_writable", "1 while the queue takes writes, 0 while it "
                                     "refuses them (no new job can be accepted).")
        writable.add_metric([], 0 if self.refusing else 1)
        yield writable


class _StreamCollector:
    def __init__(self) -> None:
        self.snapshot: list[dict[str, Any]] = []

    def collect(self):
        lag = GaugeMetricFamily("onecard_jobs_stream_lag", "Jobs in the stream not yet taken by any unit.",
                                labels=["stream"])
        pending = GaugeMetricFamily("onecard_jobs_pending", "Jobs taken by a unit and not finished (all units).",
                                    labels=["stream"])
        dead = CounterMetricFamily("onecard_jobs_dead_lettered", "Jobs moved to the dead-letter stream.",
                                   labels=["stream"])
        for s in self.snapshot:
            lag.add_metric([s["stream"]], s["lag"])
            pending.add_metric([s["stream"]], s["pending"])
            dead.add_metric([s["stream"]], s["dead_lettered"])
        yield lag
        yield pending
        yield dead


class JobsMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.jobs = Counter("onecard_jobs", "Jobs by what happened to them on this unit (submitted here, "
                            "or finished, retried, dead-lettered by this unit's consumers).", ["state"], registry=r)
        self.stage = Histogram("onecard_jobs_stage_seconds", "Job time by stage: queued (submit to start of "
                               "the run) and running (the run on the local service).", ["stage"],
                               buckets=STAGE_BUCKETS, registry=r)
        self.in_progress = Gauge("onecard_jobs_in_progress", "Jobs this unit is running now.", ["stream"],
                                 registry=r)
        self.backpressure = Counter("onecard_jobs_backpressure", "Times the local service answered 503/429 "
                                    "to a job (retried later, not counted as an attempt).", registry=r)
        self.registry_events = Counter("onecard_jobs_queue_events", "What the unit noticed of the queue: "
                                       "data_lost (its marker changed: Redis lost every job it held), reannounced "
                                       "(a model missing from its registry, put back).", ["event"], registry=r)
        for event in ("data_lost", "reannounced"):
            self.registry_events.labels(event)
        self.streams = _StreamCollector()
        r.register(self.streams)
        self.queue = _QueueCollector()
        r.register(self.queue)
        self._samples = {s: collections.deque(maxlen=2048) for s in STAGES}
        self.counts: collections.Counter[str] = collections.Counter()
        for state in ("submitted", "succeeded", "failed", "cancelled", "retried", "dead_lettered", "redriven",
                      "crashed", "isolated", "fenced"):
            self.jobs.labels(state)

    def count(self, state: str) -> None:
        self.jobs.labels(state).inc()
        self.counts[state] += 1

    def count_registry(self, event: str) -> None:
        self.registry_events.labels(event).inc()
        self.counts[event] += 1

    def observe(self, stage: str, seconds: float | None) -> None:
        if seconds is None or seconds < 0:
            return
        self.stage.labels(stage).observe(seconds)
        self._samples[stage].append(seconds)

    def percentiles(self, stage: str) -> dict[str, float | None]:
        data = sorted(self._samples[stage])
        if not data:
            return {"p50_ms": None, "p99_ms": None, "count": 0}

        def q(p: float) -> float:
            return round(data[min(len(data) - 1, int(round(p * (len(data) - 1))))] * 1000, 2)
        return {"p50_ms": q(0.5), "p99_ms": q(0.99), "count": len(data)}

    def snapshot(self, streams: list[dict[str, Any]], refusals: dict[str, int], refusing: str | None) -> None:
        """What the queue reports now, for the next scrape of the registry."""
        self.streams.snapshot = streams
        self.queue.refusals, self.queue.refusing = dict(refusals), refusing

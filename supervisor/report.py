"""What the supervisor tells: the status document (`onecard status --json`) and /metrics.

The status document's keys are stable (version 1) and documented in the README.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import psutil

from supervisor.child import ChildProcess, State
from supervisor.probe import ProbeResult

if TYPE_CHECKING:
    from supervisor.unit import Supervisor

STATUS_VERSION = 1
# Figures a service may report on GET /stats; anything else it sends is ignored.
STAT_KEYS = ("queue_depth", "in_flight", "served", "errors", "latency_p50_ms", "latency_p99_ms",
             "gpu_memory_bytes")

_cpu_marks: dict[int, tuple[float, float]] = {}


def _tree(pid: int) -> list[psutil.Process] | None:
    """A process and everything below it, or None when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return None


def _tree_times(pid: int) -> tuple[float, int] | None:
    """CPU seconds and RSS of a process and everything below it."""
    procs = _tree(pid)
    if procs is None:
        return None
    cpu, rss = 0.0, 0
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                cpu += t.user + t.system
                rss += p.memory_info().rss
        except psutil.Error:
            continue
    return cpu, rss


def _cpu_percent(pid: int, cpu_seconds: float) -> float | None:
    """CPU % of one core since the previous sample of this pid."""
    now = time.monotonic()
    prev = _cpu_marks.get(pid)
    _cpu_marks[pid] = (now, cpu_seconds)
    if prev is None or now - prev[0] < 0.05:
        return None
    return round(100.0 * (cpu_seconds - prev[1]) / (now - prev[0]), 1)


def sample_resources(child: ChildProcess) -> None:
    if not child.alive or child.pid is None:
        return
    got = _tree_times(child.pid)
    if got is None:
        return
    child.cpu_seconds, child.rss_bytes = got
    pct = _cpu_percent(child.pid, child.cpu_seconds)
    if pct is not None:
        child.cpu_percent = pct


def absorb_stats(child: ChildProcess, result: ProbeResult) -> None:
    if not result.ok:
        return
    try:
        doc = json.loads(result.body)
    except ValueError:
        return
    if isinstance(doc, dict):
        child.stats = {k: doc[k] for k in STAT_KEYS if isinstance(doc.get(k), (int, float))}


def _tree_pids(pid: int | None) -> set[int]:
    if pid is None:
        return set()
    procs = _tree(pid)
    return {pid} if procs is None else {p.pid for p in procs}


def _gpu_memory(child: ChildProcess, gpu: dict[str, Any]) -> tuple[int | None, str | None]:
    """NVML's per-process figure when our PIDs match its (not inside most containers),
    else what the service reports for itself."""
    nvml = gpu.get("per_service_bytes", {}).get(child.name)
    if nvml is not None:
        return nvml, "nvml"
    own = child.stats.get("gpu_memory_bytes")
    return (int(own), "service") if own is not None else (None, None)


def _service(child: ChildProcess, now: float, gpu: dict[str, Any]) -> dict[str, Any]:
    up = child.uptime(now)
    gpu_bytes, gpu_source = _gpu_memory(child, gpu)
    return {
        "name": child.name,
        "pid": child.pid,
        "host": child.plan.host,
        "port": child.plan.port,
        "state": child.state.value,
        "ready": child.state == State.READY,
        "uptime_s": None if up is None else round(up, 1),
        "exit_code": child.exit_code,
        "threads": child.plan.threads,
        "liveness_misses": child.liveness_misses,
        "last_probe_error": child.last_probe_error or None,
        "cpu_percent": child.cpu_percent,
        "cpu_seconds": None if child.cpu_seconds is None else round(child.cpu_seconds, 2),
        "rss_bytes": child.rss_bytes,
        "gpu_memory_bytes": gpu_bytes,
        "gpu_memory_source": gpu_source,
        "queue_depth": child.stats.get("queue_depth"),
        "in_flight": child.stats.get("in_flight"),
        "served": child.stats.get("served"),
        "errors": child.stats.get("errors"),
        "latency_p50_ms": child.stats.get("latency_p50_ms"),
        "latency_p99_ms": child.stats.get("latency_p99_ms"),
    }


def gpu_facts(sup: "Supervisor") -> dict[str, Any]:
    return sup.gpu.read({c.name: _tree_pids(c.pid) for c in sup.children if c.alive})


def snapshot(sup: "Supervisor") -> dict[str, Any]:
    now = sup.os.monotonic()
    for child in sup.children:
        sample_resources(child)
    gpu = gpu_facts(sup)
    me = _tree_times(os.getpid())
    own = psutil.Process()
    q = sup.plan.quota
    return {
        "version": STATUS_VERSION,
        "supervisor": {
            "pid": os.getpid(),
            "state": "stopping" if sup.stopping else ("running" if sup.all_ready_at else "starting"),
            "uptime_s": round(now - sup.started_at, 1),
            "all_ready": all_ready(sup),
            "stop_reason": sup.stop_reason or None,
            "cpu_percent": _cpu_percent(-1, sum(own.cpu_times()[:2])),
            "rss_bytes": own.memory_info().rss,
            "orphans_reaped": sup.orphans_reaped,
            "tree_rss_bytes": me[1] if me else None,
        },
        "cpu": {"cpus": q.cpus, "source": q.source, "affinity": q.affinity, "quota": q.quota,
                "threads_planned": sum(c.plan.threads for c in sup.children),
                "throttling": sup.throttle.summary()},
        "gpu": {k: v for k, v in gpu.items() if k != "per_service_bytes"},
        "mps": {"enabled": sup.mps is not None, "running": bool(sup.mps and sup.mps.started),
                "pipe_dir": str(sup.mps.pipe_dir) if sup.mps else None},
        "services": [_service(c, now, gpu) for c in sup.children],
    }


def all_ready(sup: "Supervisor") -> bool:
    return not sup.stopping and all(c.state == State.READY for c in sup.children)


def not_ready(sup: "Supervisor") -> list[str]:
    return [f"{c.name} ({c.state.value})" for c in sup.children if c.state != State.READY]


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(out: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[dict[str, str], Any]]) -> None:
    """One metric family: HELP, TYPE and its samples (value already formatted)."""
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{label_text}}} {value}" if labels else f"{name} {value}")


def metrics_text(sup: "Supervisor") -> str:
    """Prometheus text exposition: services, GPU, CPU quota and throttling, readiness."""
    for child in sup.children:
        sample_resources(child)
    kids = sup.children
    out: list[str] = []
    _family(out, "onecard_service_up", "gauge", "1 while the service process is alive.",
            [({"service": c.name}, 1 if c.alive else 0) for c in kids])
    _family(out, "onecard_service_state", "gauge", "1 for the state the service is in.",
            [({"service": c.name, "state": st.value}, 1 if c.state == st else 0) for c in kids for st in State])
    _family(out, "onecard_service_exits_total", "counter", "Exits of the service process seen by the supervisor.",
            [({"service": c.name}, 1 if c.exit_code is not None else 0) for c in kids])
    _family(out, "onecard_service_cpu_seconds_total", "counter", "CPU time of the service's process tree.",
            [({"service": c.name}, f"{c.cpu_seconds:.3f}") for c in kids if c.cpu_seconds is not None])
    _family(out, "onecard_service_rss_bytes", "gauge", "Resident memory of the service's process tree.",
            [({"service": c.name}, c.rss_bytes) for c in kids if c.rss_bytes is not None])
    _family(out, "onecard_service_liveness_misses", "gauge", "Liveness probes missed in a row.",
            [({"service": c.name}, c.liveness_misses) for c in kids])
    gpu = gpu_facts(sup)
    _family(out, "onecard_gpu_available", "gauge", "1 when NVML sees the GPU.",
            [({}, 1 if gpu.get("available") else 0)])
    if gpu.get("available"):
        _family(out, "onecard_gpu_memory_used_bytes", "gauge", "GPU memory in use (all processes).",
                [({}, gpu["memory_used_bytes"])])
        _family(out, "onecard_gpu_memory_total_bytes", "gauge", "GPU memory of the card.",
                [({}, gpu["memory_total_bytes"])])
        if gpu.get("utilization_percent") is not None:
            _family(out, "onecard_gpu_utilization_percent", "gauge", "GPU utilization.",
                    [({}, gpu["utilization_percent"])])
    per_service = [(c, *_gpu_memory(c, gpu)) for c in kids]
    _family(out, "onecard_service_gpu_memory_bytes", "gauge", "GPU memory per service; source nvml or service.",
            [({"service": c.name, "source": source}, used) for c, used, source in per_service if used is not None])
    _family(out, "onecard_cpu_quota_cpus", "gauge", "CPUs this container may use (cgroup quota and affinity).",
            [({}, f"{sup.plan.quota.cpus:g}")])
    thr = sup.throttle.summary()
    if thr is not None:
        _family(out, "onecard_cpu_throttled_periods_total", "counter",
                "CFS periods in which the cgroup was throttled.", [({}, thr["nr_throttled"])])
        _family(out, "onecard_cpu_periods_total", "counter", "CFS periods elapsed.", [({}, thr["nr_periods"])])
        _family(out, "onecard_cpu_throttled_seconds_total", "counter", "Time the cgroup was throttled.",
                [({}, thr["throttled_s"])])
        _family(out, "onecard_cpu_throttled_share_1m", "gauge", "Share of periods throttled over the last minute.",
                [({}, thr["throttled_share_1m"])])
    _family(out, "onecard_ready", "gauge", "1 when every service is ready.", [({}, 1 if all_ready(sup) else 0)])
    return "\n".join(out) + "\n"

"""What the supervisor tells: the status document (`onecard status --json`) and /metrics.

Built on the loop from plain data (a `UnitView`) and the sampler's last sample: nothing
here walks /proc or calls NVML. The status document's keys are stable (version 1; keys
are only ever added) and documented in docs/operating.md.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any

from supervisor.driver.child import ChildProcess
from supervisor.driver.sampler import Sample
from supervisor.policy.child_lifecycle import ChildState
from supervisor.policy.plan import CpuQuota
from supervisor.policy.unit_lifecycle import UnitLifecycle
from supervisor.version import version

STATUS_VERSION = 1


@dataclass
class UnitView:
    pid: int
    unit: UnitLifecycle
    now: float
    started_at: float
    all_ready_at: float | None
    children: list[ChildProcess]
    mps: ChildProcess | None
    mps_pipe_dir: str | None
    sample: Sample
    quota: CpuQuota
    orphans_reaped: int = 0
    log_dropped: int = 0
    probe_refused: int = 0


def _gpu_memory(child: ChildProcess, gpu: dict[str, Any]) -> tuple[int | None, str | None]:
    """NVML's per-process figure when our PIDs match its (not inside most containers),
    else what the service reports for itself."""
    nvml = gpu.get("per_service_bytes", {}).get(child.name)
    if nvml is not None:
        return nvml, "nvml"
    own = child.stats.get("gpu_memory_bytes")
    return (int(own), "service") if own is not None else (None, None)


def _service(child: ChildProcess, view: UnitView) -> dict[str, Any]:
    up = child.uptime(view.now)
    gpu_bytes, gpu_source = _gpu_memory(child, view.sample.gpu)
    tree = view.sample.trees.get(child.name) if child.alive else None
    return {
        "name": child.name,
        "pid": child.pid,
        "host": child.plan.host,
        "port": child.plan.port,
        "state": child.state.value,
        "ready": child.state == ChildState.READY,
        "uptime_s": None if up is None else round(up, 1),
        "exit_code": child.exit_code,
        "threads": child.plan.threads,
        "liveness_misses": child.liveness_misses,
        "last_probe_error": child.last_probe_error or None,
        "cpu_percent": tree.cpu_percent if tree else None,
        "cpu_seconds": round(tree.cpu_seconds, 2) if tree else None,
        "rss_bytes": tree.rss_bytes if tree else None,
        "gpu_memory_bytes": gpu_bytes,
        "gpu_memory_source": gpu_source,
        "queue_depth": child.stats.get("queue_depth"),
        "in_flight": child.stats.get("in_flight"),
        "served": child.stats.get("served"),
        "errors": child.stats.get("errors"),
        "latency_p50_ms": child.stats.get("latency_p50_ms"),
        "latency_p99_ms": child.stats.get("latency_p99_ms"),
        "drain_s": child.plan.drain_s,
        "killed": child.killed,
        "jobs": child.jobs,
        "batching": child.batching,
    }


def supervisor_state(view: UnitView) -> str:
    if view.unit.stopping:
        return "stopping"
    return "running" if view.all_ready_at is not None else "starting"


def snapshot(view: UnitView) -> dict[str, Any]:
    quota = view.quota
    sample = view.sample
    mps = view.mps
    return {
        "version": STATUS_VERSION,
        "supervisor": {
            "pid": view.pid,
            "state": supervisor_state(view),
            "uptime_s": round(view.now - view.started_at, 1),
            "all_ready": all_ready(view),
            "stop_reason": view.unit.reason or None,
            "cpu_percent": sample.own_cpu_percent,
            "rss_bytes": sample.own_rss_bytes,
            "orphans_reaped": view.orphans_reaped,
            "tree_rss_bytes": sample.own_tree_rss_bytes,
            "version": version(),
            "exit_code": view.unit.code if view.unit.stopping else None,
            "log_lines_dropped": view.log_dropped,
            "probe_connections_refused": view.probe_refused,
            "sampled_s_ago": round(max(0.0, view.now - sample.at), 1) if sample.at else None,
        },
        "cpu": {"cpus": quota.cpus, "source": quota.source, "affinity": quota.affinity, "quota": quota.quota,
                "threads_planned": sum(c.plan.threads for c in view.children),
                "throttling": sample.throttling},
        "gpu": {k: val for k, val in sample.gpu.items() if k != "per_service_bytes"},
        "mps": {"enabled": mps is not None, "running": bool(mps and mps.alive),
                "pipe_dir": view.mps_pipe_dir,
                "pid": mps.pid if mps else None, "state": mps.state.value if mps else None},
        "services": [_service(c, view) for c in view.children],
    }


def all_ready(view: UnitView) -> bool:
    return not view.unit.stopping and all(c.state == ChildState.READY for c in view.children)


def not_ready(view: UnitView) -> list[str]:
    return [f"{c.name} ({c.state.value})" for c in view.children if c.state != ChildState.READY]


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(out: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[dict[str, str], Any]]) -> None:
    """One metric family: HELP and TYPE once, then its samples (value already formatted)."""
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_esc(str(val))}"' for k, val in labels.items())
        out.append(f"{name}{{{label_text}}} {value}" if labels else f"{name} {value}")


_STARTED_AT = time.time()  # this process's start, read once: a restart shows as a new value


def metrics_text(view: UnitView) -> str:
    """Prometheus text exposition (format 0.0.4): services, GPU, CPU, the supervisor itself."""
    kids = view.children
    sample = view.sample
    out: list[str] = []
    _family(out, "process_start_time_seconds", "gauge", "Start time of the supervisor since the epoch, in seconds.",
            [({}, f"{_STARTED_AT:.3f}")])
    _family(out, "onecard_build_info", "gauge", "Version of onecard and of Python; always 1.",
            [({"version": version(), "python": platform.python_version()}, 1)])
    _family(out, "onecard_service_up", "gauge", "1 while the service process is alive.",
            [({"service": c.name}, 1 if c.alive else 0) for c in kids])
    _family(out, "onecard_service_state", "gauge", "1 for the state the service is in.",
            [({"service": c.name, "state": st.value}, 1 if c.state == st else 0) for c in kids for st in ChildState])
    _family(out, "onecard_service_exits_total", "counter", "Exits of the service process seen by the supervisor.",
            [({"service": c.name}, 1 if c.exit_code is not None else 0) for c in kids])
    trees = [(c, sample.trees.get(c.name)) for c in kids if c.alive]
    _family(out, "onecard_service_cpu_seconds_total", "counter", "CPU time of the service's process tree.",
            [({"service": c.name}, f"{t.cpu_seconds:.3f}") for c, t in trees if t is not None])
    _family(out, "onecard_service_rss_bytes", "gauge", "Resident memory of the service's process tree.",
            [({"service": c.name}, t.rss_bytes) for c, t in trees if t is not None])
    _family(out, "onecard_service_liveness_misses", "gauge", "Liveness probes missed in a row.",
            [({"service": c.name}, c.liveness_misses) for c in kids])
    gpu = sample.gpu
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
    if view.mps is not None:
        _family(out, "onecard_mps_up", "gauge", "1 while the MPS control daemon is alive.",
                [({}, 1 if view.mps.alive else 0)])
    _family(out, "onecard_cpu_quota_cpus", "gauge", "CPUs this container may use (cgroup quota and affinity).",
            [({}, f"{view.quota.cpus:g}")])
    thr = sample.throttling
    if thr is not None:
        _family(out, "onecard_cpu_throttled_periods_total", "counter",
                "CFS periods in which the cgroup was throttled.", [({}, thr["nr_throttled"])])
        _family(out, "onecard_cpu_periods_total", "counter", "CFS periods elapsed.", [({}, thr["nr_periods"])])
        _family(out, "onecard_cpu_throttled_seconds_total", "counter", "Time the cgroup was throttled.",
                [({}, thr["throttled_s"])])
        _family(out, "onecard_cpu_throttled_share_1m", "gauge", "Share of periods throttled over the last minute.",
                [({}, thr["throttled_share_1m"])])
    _family(out, "onecard_log_lines_dropped_total", "counter",
            "Log lines dropped because stdout did not keep up.", [({}, view.log_dropped)])
    _family(out, "onecard_probe_connections_refused_total", "counter",
            "Probe-port connections closed at once because too many were open.", [({}, view.probe_refused)])
    if sample.own_rss_bytes is not None:
        _family(out, "onecard_supervisor_rss_bytes", "gauge", "Resident memory of the supervisor process.",
                [({}, sample.own_rss_bytes)])
    _family(out, "onecard_ready", "gauge", "1 when every service is ready.", [({}, 1 if all_ready(view) else 0)])
    return "\n".join(out) + "\n"

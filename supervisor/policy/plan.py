"""From a validated Config to what will be started: command lines, environments, threads.

Pure: the same config, quota and base environment give the same plan, so `onecard
check` prints exactly what `onecard run` would start. What changes at each start (the
instance token) is added at spawn. The dataclasses here are light (no pydantic): the
long-running supervisor process receives the plan as JSON (cli/handover.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from supervisor.config.derived import UNIT_MEMORY_SHARE, drain_of, probe_socket_of, run_dir_of
from supervisor.config.errors import ConfigError

if TYPE_CHECKING:
    from supervisor.config.schema import Config

# Variables that size thread pools in numpy/torch/onnxruntime/OpenCV builds.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Variables a child must not inherit from the supervisor's own environment.
_DROP_PREFIXES = ("ONECARD_",)


@dataclass(frozen=True)
class CpuQuota:
    """The CPU this container may really use (system/cpu_cgroup.py reads it)."""
    cpus: float             # usable CPUs: min(cgroup quota, affinity)
    source: str             # "cgroup2", "cgroup1" or "affinity"
    affinity: int           # CPUs in this process's affinity mask
    quota: float | None     # cgroup quota in CPUs, None when unlimited
    cgroup_dir: str | None  # where cpu.stat lives, for throttling figures

    @property
    def whole_cpus(self) -> int:
        """Threads worth running: at least one, never more than the quota allows."""
        return max(1, math.floor(self.cpus + 1e-9))


@dataclass(frozen=True)
class ServicePlan:
    name: str
    host: str
    port: int
    argv: list[str]
    env: dict[str, str]       # the child's full environment
    env_own: dict[str, str]   # the part the supervisor set (shown by `check`)
    threads: int
    drain_s: float = 8.0      # the service's own drain timeout (ONECARD_DRAIN_S)
    probe_socket: str | None = None  # unix socket our runtime answers probes on (app services)


@dataclass(frozen=True)
class Plan:
    services: list[ServicePlan]
    quota: CpuQuota
    warnings: list[str] = field(default_factory=list)
    mps_dir: str | None = None   # set when [gpu] mps = true
    run_dir: str = ""            # the supervisor's private directory

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Plan:
        return cls([ServicePlan(**s) for s in doc["services"]], CpuQuota(**doc["quota"]),
                   list(doc["warnings"]), doc["mps_dir"], doc["run_dir"])


def mps_dir_of(config: Config) -> str | None:
    if not config.gpu.mps:
        return None
    return config.gpu.mps_dir or os.path.join(run_dir_of(config), "mps")


def plan_threads(config: Config, quota: CpuQuota) -> tuple[dict[str, int], list[str]]:
    """Threads per service from the quota; impossible plans are errors, tight ones warnings."""
    services = config.enabled_services()
    budget = quota.whole_cpus
    fixed = {n: s.threads for n, s in services.items() if isinstance(s.threads, int)}
    auto = [n for n, s in services.items() if s.threads == "auto"]
    problems = [
        f"services.{n}.threads: {t} threads but only {quota.cpus:g} CPUs are usable ({quota.source})"
        for n, t in fixed.items() if t > budget
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    left = budget - sum(fixed.values())
    share = max(1, left // len(auto)) if auto else 0
    threads = {**fixed, **{n: share for n in auto}}
    warnings = []
    total = sum(threads.values())
    if total > quota.cpus + 1e-9:
        warnings.append(
            f"CPU quota: services want {total} threads but only {quota.cpus:g} CPUs are usable "
            f"({quota.source}); expect throttling"
        )
    return {n: threads[n] for n in services}, warnings


def _unit_services(config: Config) -> dict[str, dict[str, str]]:
    """Each enabled app service's loopback URL: a wildcard bind is reached on 127.0.0.1."""
    out = {}
    for name, svc in config.enabled_services().items():
        if svc.app is None:
            continue
        host = "127.0.0.1" if svc.host in ("0.0.0.0", "", "::") else svc.host
        host = f"[{host}]" if ":" in host else host
        out[name] = {"url": f"http://{host}:{svc.port}"}
    return out


def plan_memory(config: Config, limit: int | None) -> dict[str, int]:
    """Each service's host memory budget in bytes, from the unit's memory limit (cgroup, else
    the machine's RAM): what a service asks for (bytes, or a share of the limit), and an
    equal share of what is left of UNIT_MEMORY_SHARE for the others. No limit known: none."""
    services = config.enabled_services()
    out: dict[str, int] = {}
    if not limit:
        return {n: s.memory_bytes for n, s in services.items() if s.memory_bytes}
    for name, svc in services.items():
        if svc.memory_bytes:
            out[name] = svc.memory_bytes
        elif svc.memory_fraction:
            out[name] = int(limit * svc.memory_fraction)
    rest = [n for n in services if n not in out]
    left = max(0, int(limit * UNIT_MEMORY_SHARE) - sum(out.values()))
    for name in rest:
        out[name] = left // len(rest)
    return out


def build_plan(config: Config, quota: CpuQuota, base_env: Mapping[str, str],
               memory_limit: int | None = None) -> Plan:
    threads, warnings = plan_threads(config, quota)
    memory = plan_memory(config, memory_limit)
    mps_dir = mps_dir_of(config)
    unit_services = json.dumps(_unit_services(config), sort_keys=True)
    plans = []
    for name, svc in config.enabled_services().items():
        if svc.command is not None:
            argv = list(svc.command)
        else:
            argv = [sys.executable, "-m", "services.runtime.serve"]
        own = {
            "ONECARD_SERVICE_NAME": name,
            "ONECARD_SERVICE_HOST": svc.host,
            "ONECARD_SERVICE_PORT": str(svc.port),
            "ONECARD_SERVICE_THREADS": str(threads[name]),
            "ONECARD_SERVICE_CONFIG": json.dumps(svc.settings, sort_keys=True),
            "ONECARD_GRACE_S": f"{config.supervisor.grace_s:g}",
            "ONECARD_DRAIN_S": f"{drain_of(config, name):g}",
            # where the unit's services listen, for a service that calls its neighbours (jobs)
            "ONECARD_UNIT_SERVICES": unit_services,
            "CUDA_VISIBLE_DEVICES": config.gpu.visible_devices,
            "PYTHONUNBUFFERED": "1",
            **{var: str(threads[name]) for var in THREAD_VARS},
        }
        probe_socket = None
        if svc.app is not None:
            own["ONECARD_SERVICE_APP"] = svc.app
            probe_socket = probe_socket_of(config, name)
            own["ONECARD_PROBE_SOCKET"] = probe_socket
        if memory.get(name):
            own["ONECARD_MEMORY_BUDGET_BYTES"] = str(memory[name])
        if svc.gpu_memory_fraction is not None:
            own["ONECARD_GPU_MEMORY_FRACTION"] = f"{svc.gpu_memory_fraction:g}"
        if svc.gpu_memory_bytes is not None:
            own["ONECARD_GPU_MEMORY_BYTES"] = str(svc.gpu_memory_bytes)
        if mps_dir is not None:
            own["CUDA_MPS_PIPE_DIRECTORY"] = os.path.join(mps_dir, "pipe")
            own["CUDA_MPS_LOG_DIRECTORY"] = os.path.join(mps_dir, "log")
            if svc.mps_thread_percentage is not None:
                own["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(svc.mps_thread_percentage)
        own.update(svc.env)
        env = {k: v for k, v in base_env.items() if not k.startswith(_DROP_PREFIXES)}
        env.update(own)
        plans.append(ServicePlan(name, svc.host, svc.port, argv, env, own, threads[name],
                                 drain_of(config, name), probe_socket))
    return Plan(plans, quota, warnings, mps_dir, run_dir_of(config))

"""The CPU this container may really use: cgroup quota and affinity, not the host's cores.

A container limited to 1.5 CPUs on a 64-core host still sees 64 cores in
``os.cpu_count()``; libraries that size their thread pools from that oversubscribe the
quota, get throttled, and a GPU service turns several times slower. Everything here
reads files under an injectable root so that tests can use fake cgroup trees.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuQuota:
    cpus: float            # usable CPUs: min(cgroup quota, affinity)
    source: str            # "cgroup2", "cgroup1" or "affinity"
    affinity: int          # CPUs in this process's affinity mask
    quota: float | None    # cgroup quota in CPUs, None when unlimited
    cgroup_dir: str | None # where cpu.stat lives, for throttling figures

    @property
    def whole_cpus(self) -> int:
        """Threads worth running: at least one, never more than the quota allows."""
        return max(1, math.floor(self.cpus + 1e-9))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup_v2(proc_self_cgroup: str | None) -> str:
    for line in (proc_self_cgroup or "").splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return "/"


def _v2_quota(root: Path, rel: str) -> tuple[float | None, Path]:
    """Walk from the process's own cgroup up to the root: the tightest cpu.max wins."""
    parts = [p for p in rel.split("/") if p]
    leaf = root.joinpath(*parts)
    if not leaf.is_dir():
        # Inside a container's cgroup namespace the root is the container's own cgroup.
        leaf, parts = root, []
    tightest: float | None = None
    for depth in range(len(parts), -1, -1):
        fields = (_read(root.joinpath(*parts[:depth]) / "cpu.max") or "").split()
        if len(fields) != 2 or fields[0] == "max":
            continue
        try:
            quota = int(fields[0]) / int(fields[1])
        except (ValueError, ZeroDivisionError):
            continue
        tightest = quota if tightest is None else min(tightest, quota)
    return tightest, leaf


def _v1_quota(root: Path) -> tuple[float | None, Path] | None:
    for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        d = root / name
        q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if q is None or p is None:
            continue
        try:
            quota, period = int(q), int(p)
        except ValueError:
            return None, d
        if quota <= 0 or period <= 0:
            return None, d
        return quota / period, d
    return None


def read_cpu_quota(
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_self_cgroup: str | None = None,
    affinity: int | None = None,
) -> CpuQuota:
    root = Path(cgroup_root)
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
    if proc_self_cgroup is None:
        proc_self_cgroup = _read(Path("/proc/self/cgroup"))

    if (root / "cgroup.controllers").exists():
        found = _v2_quota(root, _own_cgroup_v2(proc_self_cgroup))
        source = "cgroup2"
    else:
        found = _v1_quota(root)
        source = "cgroup1"
    if found is None:
        return CpuQuota(float(affinity), "affinity", affinity, None, None)
    quota, where = found
    cpus = float(affinity) if quota is None else min(quota, float(affinity))
    return CpuQuota(cpus, source, affinity, quota, str(where))

"""The CPU this container may really use: cgroup quota and affinity, not the host's cores.

A container limited to 1.5 CPUs on a 64-core host still sees 64 cores in
``os.cpu_count()``; libraries that size their thread pools from that oversubscribe the
quota, get throttled, and a GPU service turns several times slower. Everything here
reads files under an injectable root so that tests can use fake cgroup trees.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.policy.plan import CpuQuota


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


def _own_cgroup_v1(proc_self_cgroup: str | None) -> str:
    for line in (proc_self_cgroup or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            return parts[2]
    return "/"


def _v1_quota(root: Path, rel: str) -> tuple[float | None, Path] | None:
    rel_parts = [p for p in rel.split("/") if p]
    for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        base = root / name
        for d in (base.joinpath(*rel_parts), base):  # our own cgroup, else the namespace root
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
        found = _v1_quota(root, _own_cgroup_v1(proc_self_cgroup))
        source = "cgroup1"
    if found is None:
        return CpuQuota(float(affinity), "affinity", affinity, None, None)
    quota, where = found
    cpus = float(affinity) if quota is None else min(quota, float(affinity))
    return CpuQuota(cpus, source, affinity, quota, str(where))


@dataclass(frozen=True)
class CpuStat:
    nr_periods: int
    nr_throttled: int
    throttled_s: float


def read_cpu_stat(quota: CpuQuota) -> CpuStat | None:
    """Throttling counters of our cgroup (v2 throttled_usec, v1 throttled_time in ns)."""
    if quota.cgroup_dir is None:
        return None
    text = _read(Path(quota.cgroup_dir) / "cpu.stat")
    if text is None:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            fields[key] = int(value.strip())
        except ValueError:
            continue
    if "nr_periods" not in fields:
        return None
    if "throttled_usec" in fields:
        throttled = fields["throttled_usec"] / 1e6
    else:
        throttled = fields.get("throttled_time", 0) / 1e9
    return CpuStat(fields["nr_periods"], fields.get("nr_throttled", 0), throttled)


class ThrottleWindow:
    """Samples cpu.stat and tells how throttled we were over the last minute."""

    def __init__(self, quota: CpuQuota, clock=None, window_s: float = 60.0,
                 reader=read_cpu_stat):
        self.quota = quota
        self.clock = clock or time.monotonic
        self.window_s = window_s
        self.reader = reader
        self.samples: collections.deque[tuple[float, CpuStat]] = collections.deque()

    def sample(self) -> CpuStat | None:
        stat = self.reader(self.quota)
        if stat is None:
            return None
        now = self.clock()
        self.samples.append((now, stat))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        return stat

    def summary(self) -> dict | None:
        latest = self.sample()
        if latest is None:
            return None
        t0, first = self.samples[0]
        t1 = self.samples[-1][0]
        periods = latest.nr_periods - first.nr_periods
        return {
            "nr_periods": latest.nr_periods,
            "nr_throttled": latest.nr_throttled,
            "throttled_s": round(latest.throttled_s, 3),
            "window_s": round(t1 - t0, 1),
            "throttled_share_1m": (round((latest.nr_throttled - first.nr_throttled) / periods, 4)
                                   if periods > 0 else 0.0),
            "throttled_s_1m": round(latest.throttled_s - first.throttled_s, 3),
        }

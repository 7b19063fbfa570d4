"""How many pytest-xdist workers ./dev.sh test starts: two per CPU this process may use (much
of a test is waiting on processes, deadlines and sockets: on 2 cores 4 workers end in 6.5
min where 2 took 8.7), counting a cgroup v2 CPU quota (a 2-CPU container on a 64-core host
is 2 CPUs), and at most 8 (each worker runs whole units: memory, and one GPU on a GPU box)."""

from __future__ import annotations

import math
import os
from pathlib import Path

MAX_WORKERS = 8


def cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def count(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    return max(1, min(MAX_WORKERS, 2 * cpus(cgroup_root)))

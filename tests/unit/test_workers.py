"""The number of test workers ./dev.sh starts (tests/workers.py), from a cgroup's cpu.max."""

from __future__ import annotations

import os

from tests.workers import MAX_WORKERS, count, cpus


def test_a_cpu_quota_counts_and_the_count_is_bounded(tmp_path):
    online = len(os.sched_getaffinity(0))
    assert cpus(tmp_path) == online                       # no cpu.max: every CPU it may use
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpus(tmp_path) == online
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert cpus(tmp_path) == min(online, 2) and count(tmp_path) == min(2 * min(online, 2), MAX_WORKERS)
    (tmp_path / "cpu.max").write_text("1000 100000\n")
    assert cpus(tmp_path) == 1 and count(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("garbage")
    assert cpus(tmp_path) == online
    assert 1 <= count() <= MAX_WORKERS

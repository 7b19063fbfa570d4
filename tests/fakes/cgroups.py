"""Fake cgroup trees in a temporary directory, laid out as the kernel lays out the real
ones, for the readers that take a root (supervisor/system/cpu_cgroup.py)."""

from __future__ import annotations

from pathlib import Path


def v2_tree(tmp_path: Path, cpu_max: str | None, rel: str = "") -> Path:
    """A cgroup v2 hierarchy; `cpu_max` ("QUOTA PERIOD" or "max PERIOD") in the cgroup `rel`."""
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    leaf = root / rel if rel else root
    leaf.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (leaf / "cpu.max").write_text(cpu_max + "\n")
    return root


def v1_cpu_tree(tmp_path: Path, controller: str, quota_us: int, period_us: int = 100000) -> Path:
    """A cgroup v1 hierarchy with the cpu controller mounted as `controller` ("cpu,cpuacct", "cpu")."""
    d = tmp_path / "cg1" / controller
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return tmp_path / "cg1"


def cpu_stat(directory: Path, text: str) -> Path:
    """A cgroup's cpu.stat (v2: throttled_usec; v1: throttled_time in ns)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.stat").write_text(text)
    return directory

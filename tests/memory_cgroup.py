"""A real memory cgroup for a test's processes (cgroup v2, else v1), removed afterwards.

Tests that need one skip where none can be made (not root, no memory controller), and say so.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


class MemoryCgroup:
    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def peak(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def usage(self) -> int | None:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def reset_peak(self) -> bool:
        """Start a new peak at the current usage (v1: max_usage_in_bytes; v2: memory.peak
        takes a reset from Linux 6.12 on). False where the kernel cannot."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            (self.path / name).write_text("0" if self.version == 1 else "reset")
            return True
        except OSError:
            return False

    def prefix(self) -> list[str]:
        """What to put before a command line so that it starts inside this cgroup."""
        return self.wrap([])

    def wrap(self, argv: list[str]) -> list[str]:
        """The command, started inside this cgroup (its shell moves itself in, then execs)."""
        return ["sh", "-c", f'echo $$ > "{self.procs}" && exec "$@"', "sh", *argv]


def _make(limit: int) -> MemoryCgroup | None:
    name = f"onecard-test-{uuid.uuid4().hex[:8]}"
    if os.geteuid() != 0:
        return None
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        own = Path(open("/proc/self/cgroup").read().strip().split("::", 1)[-1].lstrip("/"))
        parent = V2 / own.parent if (V2 / own / "cgroup.procs").exists() else V2
        try:
            path = parent / name
            path.mkdir()
            (path / "memory.max").write_text(str(limit))
            (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
            return MemoryCgroup(path, 2)
        except OSError:
            return None
    if V1.is_dir():
        try:
            path = V1 / name
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit))
            return MemoryCgroup(path, 1)
        except OSError:
            return None
    return None


def make_memory_cgroup(limit: int) -> MemoryCgroup | None:
    """A new memory cgroup of `limit` bytes, or None where none can be made (for callers that are
    not tests: the bench). Remove it with remove_memory_cgroup once its processes are gone."""
    return _make(limit)


def remove_memory_cgroup(group: MemoryCgroup, wait_s: float = 5.0) -> bool:
    for _ in range(max(1, int(wait_s / 0.1))):
        try:
            group.path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    group = _make(limit)
    if group is None:
        pytest.skip("cannot make a memory cgroup here (not root, or no memory controller)")
    try:
        yield group
    finally:
        for _ in range(50):  # the processes in it must be gone first
            try:
                group.path.rmdir()
                break
            except OSError:
                time.sleep(0.1)

"""Host memory facts: the limit this process lives under (the supervisor plans each
service's budget from it; the services' cost model checks against it), its resident and
peak memory, and handing freed heap back to the kernel.

The limit is the container's (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``),
never larger than the machine's RAM. The peak (``VmHWM``) can be reset
(``/proc/self/clear_refs``, Linux 4.0+), so a warm-up call's peak is measured exactly,
not sampled. Everything reads files under an injectable root so that tests can use fake
trees; every reader answers None rather than raise when a file is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_UNLIMITED = 1 << 60  # cgroup v1 writes ~2**63 for "no limit"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _own_cgroup(root: str, controller: str) -> str:
    """This process's cgroup path for `controller` (v1) or the unified one (v2, controller '')."""
    text = _read(os.path.join(root, "proc/self/cgroup")) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (controller and controller in parts[1].split(",")) or (not controller and parts[0] == "0"):
            return parts[2].lstrip("/")
    return ""


def _limit_in(directory: str, names: tuple[str, ...]) -> int | None:
    for name in names:
        text = _read(os.path.join(directory, name))
        if text is None:
            continue
        text = text.strip()
        if text and text != "max" and text.isdigit() and int(text) < _UNLIMITED:
            return int(text)
    return None


def cgroup_memory_limit(root: str = "/") -> int | None:
    """The tightest memory limit on this process's cgroup path, or None."""
    limits = []
    for controller, base, names in (("", "sys/fs/cgroup", ("memory.max",)),
                                    ("memory", "sys/fs/cgroup/memory", ("memory.limit_in_bytes",))):
        rel = _own_cgroup(root, controller)
        directory = os.path.join(root, base, rel)
        # a limit set on any ancestor applies too (the container's own is often the parent)
        while True:
            found = _limit_in(directory, names)
            if found is not None:
                limits.append(found)
            if not rel:
                break
            rel = os.path.dirname(rel)
            directory = os.path.join(root, base, rel)
    return min(limits) if limits else None


def machine_memory(root: str = "/") -> int | None:
    text = _read(os.path.join(root, "proc/meminfo")) or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def memory_limit(root: str = "/") -> int | None:
    """What this process may use at most: the cgroup limit, capped by the machine's RAM."""
    values = [v for v in (cgroup_memory_limit(root), machine_memory(root)) if v]
    return min(values) if values else None


def _status_kb(field: str) -> int | None:
    text = _read("/proc/self/status") or ""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def resident_bytes() -> int | None:
    return _status_kb("VmRSS")


def peak_bytes() -> int | None:
    return _status_kb("VmHWM")


def reset_peak() -> bool:
    """Start a new peak at the current resident size; False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


_libc = None


def trim_heap() -> None:
    """Give freed heap pages back to the kernel (glibc malloc_trim); a no-op elsewhere. After a
    big request the allocator otherwise keeps its peak for the life of the process."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


DEFAULT_SHARE = 0.3  # of the container's memory, for a service whose budget neither it nor the supervisor set


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def service_memory(configured: int | None, fraction: float | None, environ=os.environ,
                   limit: int | None = None) -> tuple[int | None, str]:
    """(bytes, where the figure comes from): the setting, else the supervisor's plan, else a
    share of the container's limit (or of the machine's RAM)."""
    if configured:
        return configured, "memory_budget_bytes"
    planned = environ.get("ONECARD_MEMORY_BUDGET_BYTES", "").strip()
    if planned.isdigit() and int(planned) > 0:
        return int(planned), "the supervisor's plan"
    limit = limit if limit is not None else memory_limit()
    if not limit:
        return None, "unknown"
    share = fraction if fraction is not None else DEFAULT_SHARE
    return int(limit * share), f"{share:g} of the memory limit {mib(limit)}"

"""The process table as the containment needs it, from /proc: standard library only (the
sentinel imports it in a bare interpreter), synchronous (called in worker threads).

A process of a unit is recognised by the marker in its environment (containment.py):
``ONECARD_UNIT_ID`` (the unit) and ``ONECARD_RUN_ID`` (one start of it). /proc/PID/environ
is the environment the process was started with, which its descendants inherit.
"""

from __future__ import annotations

import os

UNIT_VAR = "ONECARD_UNIT_ID"
RUN_VAR = "ONECARD_RUN_ID"
SERVICE_VAR = "ONECARD_SERVICE_NAME"


def read_file(path: str, mode: str = "r") -> str | bytes | None:
    try:
        with open(path, mode) as fh:
            return fh.read()
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    """True for a running process, False for a zombie or a pid that is gone."""
    stat = read_file(f"/proc/{pid}/stat")
    if not stat:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def cmdline(pid: int, limit: int = 120) -> str:
    raw = read_file(f"/proc/{pid}/cmdline", "rb") or b""
    text = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
    return (text or "?")[:limit]


def environ(pid: int) -> dict[str, str]:
    raw = read_file(f"/proc/{pid}/environ", "rb")
    if not raw:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key.startswith(b"ONECARD_"):
            out[key.decode("ascii", "replace")] = value.decode("utf-8", "replace")
    return out


def all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []


def marked(unit: str, run: str | None = None, service: str | None = None,
           not_run: str | None = None) -> set[int]:
    """Live processes whose environment carries the unit's marker (and this run's, this
    service's, or any run but one)."""
    me = os.getpid()
    needle = f"{UNIT_VAR}={unit}".encode()
    out = set()
    for pid in all_pids():
        if pid == me:
            continue
        raw = read_file(f"/proc/{pid}/environ", "rb")
        if not raw or needle not in raw:
            continue
        env = environ(pid)
        if env.get(UNIT_VAR) != unit:
            continue
        if run is not None and env.get(RUN_VAR) != run:
            continue
        if not_run is not None and env.get(RUN_VAR) == not_run:
            continue
        if service is not None and env.get(SERVICE_VAR) != service:
            continue
        if alive(pid):
            out.add(pid)
    return out


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        text = read_file(f"/proc/{pid}/task/{tid}/children")
        if text:
            out.extend(int(x) for x in text.split())
    return out


def tree(root: int | None) -> set[int]:
    """A live process and its live descendants (process mode; the supervisor's own orphans)."""
    if root is None:
        return set()
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children_of(pid))
    return {p for p in out if alive(p)}


def kill_each(pids: set[int], sig: int) -> set[int]:
    sent = set()
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent.add(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sent

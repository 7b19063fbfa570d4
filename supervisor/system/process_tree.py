"""A process and its descendants, and what they use, from the process table (psutil and
/proc): for the sampler's figures and the probes' identity check.

Synchronous, and slow on a busy host: called in worker threads, never on the loop.
"""

from __future__ import annotations

import os

import psutil

Key = tuple[int, float]  # (pid, start time): a reused pid is another process


def _ppid_map() -> dict[int, int]:
    out = {}
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if ppid is not None:
            out[p.pid] = ppid
    return out


def _proc_children(pid: int) -> list[int] | None:
    """Direct children from /proc/PID/task/*/children (Linux 3.5+): a walk down a tree costs
    what the tree holds, not a pass over every process of the host. None where unsupported."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    except OSError:
        return None
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out.extend(int(x) for x in fh.read().split())
        except FileNotFoundError:
            if tid == str(pid) and not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None  # the kernel has no children files
        except (OSError, ValueError):
            continue
    return out


def tree_pids(root: int, ppids: dict[int, int] | None = None) -> set[int]:
    """A process and every descendant."""
    if ppids is None:
        out, todo = set(), [root]
        while todo:
            pid = todo.pop()
            if pid in out:
                continue
            kids = _proc_children(pid)
            if kids is None:
                return tree_pids(root, _ppid_map())
            if pid == root and not kids and not psutil.pid_exists(root):
                return set()
            out.add(pid)
            todo.extend(kids)
        return out
    if root not in ppids and not psutil.pid_exists(root):
        return set()
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


def read_tree(pids: set[int]) -> tuple[dict[Key, float], int, dict[Key, int]]:
    """Per process: CPU seconds (its own and its waited-for children's), RSS sum, parents."""
    cpu: dict[Key, float] = {}
    parents: dict[Key, int] = {}
    rss = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                t = p.cpu_times()
                key = (pid, p.create_time())
                cpu[key] = t.user + t.system + t.children_user + t.children_system
                parents[key] = p.ppid()
                rss += p.memory_info().rss
        except psutil.Error:
            continue
    return cpu, rss, parents


def listening_pids(port: int, pids: set[int]) -> set[int]:
    """Which of `pids` has a listening TCP socket on `port`."""
    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.Error, AttributeError):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            out.add(pid)
    return out


def own_usage() -> tuple[float, int]:
    """This process's own CPU seconds (not its reaped children's) and resident bytes."""
    own = psutil.Process(os.getpid())
    with own.oneshot():
        t = own.cpu_times()
        return t.user + t.system, own.memory_info().rss

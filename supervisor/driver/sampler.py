"""Process-table, NVML and cgroup figures, sampled in a worker thread.

psutil walks /proc and NVML calls into the driver; either can be slow, and neither may
stall the loop that reacts to a death. One thread samples every `period_s` (sooner when
asked); the loop only reads `latest`, an immutable snapshot, or awaits a fresh one with a
deadline. CPU seconds are accounted per process and never go back when a process of a
service's tree exits: a counter that goes back breaks every rate computed from it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.system.process_tree import Key, own_usage, read_tree, tree_pids
from supervisor.system.signal_mask import quiet_thread


@dataclass(frozen=True)
class TreeFigures:
    cpu_seconds: float          # monotonic: what the tree has used since it started
    cpu_percent: float | None   # of one core, since the previous sample; None on the first
    rss_bytes: int
    pids: frozenset[int]


@dataclass(frozen=True)
class Sample:
    at: float = 0.0
    trees: dict[str, TreeFigures] = field(default_factory=dict)
    gpu: dict[str, Any] = field(default_factory=lambda: {"available": False, "reason": "not sampled yet"})
    throttling: dict[str, Any] | None = None
    own_cpu_percent: float | None = None
    own_rss_bytes: int | None = None
    own_tree_rss_bytes: int | None = None


class CpuAccount:
    """CPU seconds of a changing tree of processes that never decrease.

    Each process counts its own time and that of the children it has waited for
    (cutime, cstime): a process that exits and is reaped by its parent in the tree moves
    its time into the parent's figure. One that disappears while its parent is gone from
    the tree (reaped elsewhere) keeps contributing what it was last seen to use. The
    total is kept monotonic whatever the process table says."""

    def __init__(self) -> None:
        self._last: dict[Key, float] = {}
        self._parents: dict[Key, int] = {}
        self._gone = 0.0
        self.total = 0.0

    def update(self, per_process: dict[Key, float], parents: dict[Key, int] | None = None) -> float:
        parents = parents or {}
        alive_pids = {pid for pid, _ in per_process}
        for key, used in self._last.items():
            if key not in per_process and parents.get(key, self._parents.get(key)) not in alive_pids:
                self._gone += used
        self._parents = {**{k: v for k, v in self._parents.items() if k in per_process}, **parents}
        for key, used in per_process.items():
            prev = self._last.get(key)
            if prev is not None and used < prev:  # cannot happen for one process; keep what was seen
                per_process[key] = prev
        self._last = dict(per_process)
        self.total = max(self.total, self._gone + sum(per_process.values()))
        return self.total


class Sampler:
    """The worker thread. `targets` (service name -> pid) is replaced by the loop; the
    thread reads it. `extra` callables run in the thread each round (socket watch)."""

    def __init__(self, gpu: Any = None, throttle: Any = None, period_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.gpu = gpu
        self.throttle = throttle
        self.period_s = period_s
        self.clock = clock
        self.targets: dict[str, int] = {}
        self.extra: list[Callable[[], None]] = []
        self.latest = Sample()
        self._accounts: dict[tuple[str, int], CpuAccount] = {}
        self._marks: dict[Any, tuple[float, float]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="onecard-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request(self) -> None:
        self._wake.set()

    async def fresh(self, max_age_s: float, timeout_s: float) -> Sample:
        """The latest sample if recent enough, else a new one awaited at most timeout_s
        (then whatever is latest: a stuck NVML never holds a status request)."""
        if self.clock() - self.latest.at <= max_age_s or self._thread is None:
            return self.latest
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._waiters.append((loop, fut))
        self._wake.set()
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return self.latest

    def _main(self) -> None:
        quiet_thread()
        while not self._stop.is_set():
            try:
                self.latest = self.sample_once()
            except Exception:  # noqa: BLE001 - a figure, never a reason to stop sampling
                self.errors += 1
            for fn in self.extra:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a watch that fails must not stop the sampling either
                    self.errors += 1
            with self._lock:
                waiters, self._waiters = self._waiters, []
            for loop, fut in waiters:
                try:
                    loop.call_soon_threadsafe(_resolve, fut, self.latest)
                except RuntimeError:  # that loop is closed
                    pass
            self._wake.wait(self.period_s)
            self._wake.clear()

    def _percent(self, key: Any, seconds: float, now: float) -> float | None:
        prev = self._marks.get(key)
        self._marks[key] = (now, seconds)
        if prev is None or now - prev[0] < 0.05:
            return None
        return round(max(0.0, 100.0 * (seconds - prev[1]) / (now - prev[0])), 1)

    def sample_once(self) -> Sample:
        now = self.clock()
        trees: dict[str, TreeFigures] = {}
        targets = dict(self.targets)
        for name, pid in targets.items():
            pids = tree_pids(pid)
            if not pids:
                continue
            cpu, rss, parents = read_tree(pids)
            account = self._accounts.setdefault((name, pid), CpuAccount())
            total = account.update(cpu, parents)
            trees[name] = TreeFigures(total, self._percent((name, pid), total, now), rss, frozenset(pids))
        for key in [k for k in self._accounts if targets.get(k[0]) != k[1]]:
            del self._accounts[key]
        own_seconds, own_rss = own_usage()
        _, tree_rss, _ = read_tree(tree_pids(os.getpid()))
        gpu = self.gpu.read({n: set(t.pids) for n, t in trees.items()}) if self.gpu is not None else \
            {"available": False, "reason": "not sampled"}
        throttling = self.throttle.summary() if self.throttle is not None else None
        return Sample(now, trees, gpu, throttling, self._percent("self", own_seconds, now), own_rss, tree_rss)


def _resolve(fut: asyncio.Future, value: Sample) -> None:
    if not fut.done():
        fut.set_result(value)

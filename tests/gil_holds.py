"""How long work keeps the GIL in one stretch, seen from another thread.

Forced switches are turned off while it runs (a 10 s switch interval), so a ticker thread
that sleeps 0.1 ms between ticks can only tick while the work has released the GIL: a long
gap between ticks is a stretch the work held it. A busy machine (the other test workers)
stretches gaps too, by preempting either thread, so a gap is counted as a hold only as far
as it is not the scheduler's: not beyond the CPU time the work's thread spent in it (its
thread CPU clock, which stops while it waits to run), and less the time the ticker itself
waited to run (its run delay, /proc/thread-self/schedstat). A real hold is the work's CPU
while the ticker sleeps on the GIL, so it counts whole. Both threads also run at a high
priority (nice -15) where the process may raise it (root, CAP_SYS_NICE), and the shortest
of a few tries is what the work itself does."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable


def longest_gil_hold_s(work: Callable[[], object], tries: int = 3) -> float:
    best = float("inf")
    before = sys.getswitchinterval()
    niceness = _raise_priority()
    sys.setswitchinterval(10)
    delay = _RunDelay()
    try:
        for _ in range(tries):
            go, done, leave = threading.Event(), threading.Event(), threading.Event()
            failure: list[BaseException] = []

            def run(go=go, done=done, leave=leave, failure=failure) -> None:
                go.wait()
                _raise_priority()
                try:
                    work()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    failure.append(exc)
                finally:
                    done.set()
                    leave.wait()  # alive until the last tick has read its CPU clock

            th = threading.Thread(target=run)
            th.start()
            cpu = _cpu_clock(th)
            gap = 0.0
            last, last_cpu, last_delay = time.perf_counter(), cpu(), delay()
            go.set()
            try:
                while True:  # at least one tick: work that holds the GIL from its start to its end is seen
                    time.sleep(0.0001)
                    now, now_cpu, now_delay = time.perf_counter(), cpu(), delay()
                    gap = max(gap, min(now - last - (now_delay - last_delay), now_cpu - last_cpu))
                    last, last_cpu, last_delay = now, now_cpu, now_delay
                    if done.is_set():
                        break
            finally:
                leave.set()
                th.join()
            if failure:
                raise failure[0]
            best = min(best, gap)
    finally:
        delay.close()
        sys.setswitchinterval(before)
        if niceness is not None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    return best


def _cpu_clock(thread: threading.Thread) -> Callable[[], float]:
    """The thread's CPU time in seconds, as a function; +inf always where there is no
    per-thread clock (the gaps are then bounded by the run delay alone)."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return lambda: float("inf")
    return lambda: time.clock_gettime(clock)


class _RunDelay:
    """The calling thread's time spent runnable but not running, in seconds (0 where the
    kernel does not say)."""

    def __init__(self):
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self()
        except (OSError, ValueError, IndexError):
            self.close()

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
        self._fd = None


HIGH_PRIORITY = -15


def _raise_priority() -> int | None:
    """The calling thread at HIGH_PRIORITY (Linux nice is per thread); its niceness before,
    None where that is not allowed."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, HIGH_PRIORITY)
        return before
    return None

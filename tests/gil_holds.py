"""How long work keeps the GIL in one stretch, seen from another thread.

Forced switches are turned off while it runs (a 10 s switch interval), so a ticker thread
that sleeps 0.1 ms between ticks can only tick while the work has released the GIL: the
longest gap between ticks is the longest stretch the work held it. A preempted machine
stretches a gap now and then, so the shortest of a few tries is what the work itself
does; and both threads run at a high priority (nice -15) where the process may raise it
(root, CAP_SYS_NICE), so that other processes on a busy machine (the other test workers)
preempt neither of them."""

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
    try:
        for _ in range(tries):
            go, done = threading.Event(), threading.Event()
            failure: list[BaseException] = []

            def run(go=go, done=done, failure=failure) -> None:
                go.wait()
                _raise_priority()
                try:
                    work()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    failure.append(exc)
                finally:
                    done.set()

            th = threading.Thread(target=run)
            th.start()
            gap, last = 0.0, time.perf_counter()
            go.set()
            while True:  # at least one tick: work that holds the GIL from its start to its end is seen
                time.sleep(0.0001)
                now = time.perf_counter()
                gap, last = max(gap, now - last), now
                if done.is_set():
                    break
            th.join()
            if failure:
                raise failure[0]
            best = min(best, gap)
    finally:
        sys.setswitchinterval(before)
        if niceness is not None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    return best


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

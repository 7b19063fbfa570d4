"""One way for every test harness to end what it started, even when the test failed: the
process, every descendant seen, and its process group are SIGKILLed, then all of them are
reaped (bounded waits), so that no orphan or zombie outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable

import psutil


def end_process_tree(proc: subprocess.Popen, seen: Iterable[psutil.Process] = (), timeout: float = 10.0,
                     others_timeout: float = 5.0) -> None:
    """SIGKILL `proc`, its descendants (those alive now and those in `seen`, recorded while
    it ran: a descendant may have left the tree) and its process group when it leads one
    (harnesses start it with start_new_session), then reap `proc` and wait for the rest."""
    procs: dict[int, psutil.Process] = {p.pid: p for p in seen}
    try:
        root = psutil.Process(proc.pid)
        procs.setdefault(root.pid, root)
        for p in root.children(recursive=True):
            procs.setdefault(p.pid, p)
    except psutil.Error:
        pass
    for p in procs.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        if os.getpgid(proc.pid) == proc.pid:  # never the test runner's own group
            os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    psutil.wait_procs([p for pid, p in procs.items() if pid != proc.pid], timeout=others_timeout)

"""The GIL-hold measure of tests/gil_holds.py is about the work, not the scheduler: on a busy
machine (xdist workers outnumbering the cores, no right to raise priority in CI) the threads
are preempted for milliseconds at a time, and a measure of wall-clock gaps between a ticker's
ticks charged that to the work (a PNG encode that keeps the GIL 2 ms at a time read as 9 ms
against OpenCV's 15, and the comparison failed one run in four)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# one CPU shared with a process that spins, and no priority raised (as for a CI user without
# CAP_SYS_NICE): work that releases the GIL all along, and work that keeps it for 40 ms of CPU
SCRIPT = textwrap.dedent("""
    import hashlib, os, subprocess, sys, time
    import tests.gil_holds as gh
    gh._raise_priority = lambda: None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    spin = subprocess.Popen([sys.executable, "-c",
                             f"import os; os.sched_setaffinity(0, {{{cpu}}})\\nwhile True: pass"])
    try:
        time.sleep(0.1)
        data = os.urandom(4 << 20)

        def releases():  # hashlib releases the GIL for all of a big buffer
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.25:
                hashlib.sha256(data).digest()

        def keeps():  # forced switches are off while it is measured: 40 ms of CPU with the GIL
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.04:
                pass

        print(gh.longest_gil_hold_s(releases), gh.longest_gil_hold_s(keeps, tries=2))
    finally:
        spin.kill()
        spin.wait()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
def test_preemption_is_not_counted_as_holding_the_gil():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    releases, keeps = map(float, out.stdout.split())
    # a real hold is seen whole, as the work's 40 ms of CPU: not as the 80 ms of wall clock it
    # took beside the spinner
    assert 0.03 <= keeps < 0.06, (releases, keeps)
    assert releases < keeps / 4, (releases, keeps)  # preemption on a shared CPU is not a hold

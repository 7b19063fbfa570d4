"""The start-up heap is frozen and the collector runs less often from then on (shell.heap)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import pythonpath


def test_the_start_up_heap_is_frozen_and_young_objects_are_collected_less_often():
    code = ("import gc, json; from services.runtime.shell.heap import SERVER_THRESHOLDS, freeze_startup_heap; "
            "before = gc.get_threshold(); frozen = freeze_startup_heap(); "
            "print(json.dumps([before, gc.get_threshold(), list(SERVER_THRESHOLDS), frozen]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"}, check=True).stdout
    before, after, wanted, frozen = json.loads(out)
    assert after == wanted and after[0] >= 10 * before[0] and frozen > 1000

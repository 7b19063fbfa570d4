"""A real child writing the same line thousands of times through a real pipe: the unit's log
gets it once, and how many were held back (supervisor.driver.child_output)."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys

from supervisor.config.settings import SupervisorSettings
from supervisor.driver.child_output import ChildOutput
from supervisor.driver.logs import LogSink, Tail
from supervisor.driver.port import DriverPort
from supervisor.policy.unit_lifecycle import UnitLifecycle
from supervisor.system.clock import LoopClock
from supervisor.system.os_layer import OsLayer


def test_a_child_repeating_one_line_writes_it_once_with_the_count():
    stream = io.BytesIO()
    log = LogSink(stream=stream)
    port = DriverPort(SupervisorSettings(), OsLayer(), LoopClock(), log, UnitLifecycle(), [])
    code = ("import sys\nfor _ in range(5000): print('libpng error: IDAT: CRC error', file=sys.stderr)\n"
            "print('done', file=sys.stderr)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    tail = Tail()

    async def pump() -> None:
        done = ChildOutput(port).attach("detect", child.stderr.fileno(), tail=tail)
        await asyncio.wait_for(done, 30)
    try:
        asyncio.run(pump())
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert log.flush(5)
    lines = stream.getvalue().decode().splitlines()
    assert sum("CRC error" in line for line in lines) == 1, lines[:5]
    assert any("repeated 4999 more times" in line for line in lines) and lines[-1].endswith("done"), lines
    assert tail.lines()[-1] == "done"

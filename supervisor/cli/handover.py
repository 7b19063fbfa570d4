"""`onecard run` hands over to a lean process: the same PID, without pydantic or typer.

The command line validates the config (pydantic) and builds the plan, then execs a fresh
interpreter that imports only what supervising needs (cli/supervise.py): a supervisor
that carried pydantic and typer for its whole life would cost every unit tens of MB of
RSS for nothing. The plan travels as JSON in an anonymous memory file (memfd), not in the
environment or argv, where other processes could read the secrets a service's env holds.
exec keeps the PID, so a supervisor that is PID 1 stays PID 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.config.schema import Config
    from supervisor.policy.plan import Plan


def exec_supervisor(config: Config, plan: Plan) -> None:
    """Replace this process with the lean supervisor; returns only when that cannot be done."""
    if not hasattr(os, "memfd_create"):
        return
    doc = {"supervisor": dataclasses.asdict(config.supervisor), "gpu": dataclasses.asdict(config.gpu),
           "plan": plan.to_json()}
    fd = os.memfd_create("onecard-plan", 0)  # inherited across exec on purpose
    data = memoryview(json.dumps(doc).encode())
    while data:
        data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
    root = str(Path(__file__).resolve().parents[2])  # the checkout that holds the supervisor package
    code = f"import sys; sys.path.insert(0, {root!r}); from supervisor.cli.supervise import main; main({fd})"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a full disk, a reader gone: nothing to lose but the bytes
            pass
    os.execv(sys.executable, [sys.executable, "-c", code])

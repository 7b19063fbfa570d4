"""What `onecard` does before anything else, in its first milliseconds.

Signals: from the first instruction of `onecard run` the stop signals and SIGCHLD are
blocked, as tini and dumb-init do, so that one sent while the interpreter imports, the
config is validated or the lean supervisor is exec'd (handover.py; the mask survives exec)
waits instead of being lost: the kernel drops a signal that PID 1 has no handler for, and
kills any other process with it. The driver unblocks them once its handlers exist and
blocks them again for good when it has chosen its exit code (system/signal_mask.py).

Standard streams: `onecard run >&- 2>&-` (as some init systems start daemons) would leave
fds 0-2 closed; the next file or socket opened would take their numbers, and log lines
would go into it. They are opened on /dev/null instead: the unit runs, its lines are lost.
"""

from __future__ import annotations

import os
import sys

from supervisor.system import signal_mask


def standard_streams() -> None:
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8",
                                    errors="backslashreplace", closefd=False))


def command_of(argv: list[str]) -> str | None:
    return next((a for a in argv[1:] if not a.startswith("-")), None)


def prepare(argv: list[str]) -> None:
    if command_of(argv) == "run":
        signal_mask.block()
    standard_streams()

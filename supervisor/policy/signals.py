"""What each signal a container runtime or a terminal sends means to the supervisor."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # graceful, like tini/s6/gunicorn's TERM
INTERRUPT_SIGNALS = (signal.SIGINT,)                            # graceful; twice: kill now
IGNORED_SIGNALS = (signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2)  # never stop us
# Blocked from the first instruction of `onecard run` until their handlers exist, and again
# once the exit code is chosen (cli/early.py, system/signal_mask.py).
HANDLED_SIGNALS = STOP_SIGNALS + INTERRUPT_SIGNALS + (signal.SIGCHLD,)

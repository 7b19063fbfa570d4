"""The supervisor's signal mask: which thread may take a signal, and when.

From the first instruction of `onecard run` the stop signals and SIGCHLD are blocked
(cli/early.py), as tini and dumb-init do, so that one sent while the interpreter imports,
the config is validated or the lean supervisor is exec'd waits instead of being lost (the
mask survives exec). The driver unblocks them once its handlers exist and blocks them
again for good when it has chosen its exit code. Every thread the supervisor starts blocks
them (`quiet_thread`), so that only the main thread ever takes one.
"""

from __future__ import annotations

import signal

from supervisor.policy.signals import HANDLED_SIGNALS


def block(sigs: tuple[int, ...] = HANDLED_SIGNALS) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)


def unblock(sigs: tuple[int, ...] = HANDLED_SIGNALS) -> None:
    """What arrived while they were blocked is delivered now, to the handlers."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def quiet_thread() -> None:
    """At the start of every thread of the supervisor: signals are the main thread's."""
    block(HANDLED_SIGNALS)

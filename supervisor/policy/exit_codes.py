"""The unit's exit codes: what the orchestrator (and the operator) learns from `onecard run`.

Documented in docs/supervisor.md ("Exit codes"); the rules that choose one are in
unit_lifecycle.py and child_lifecycle.py.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_CONTROL_FAILED = 1        # control socket or run directory unusable; nothing started
EXIT_CONFIG = 2                # invalid configuration (the CLI); nothing started
EXIT_STARTUP_TIMEOUT = 3
EXIT_LIVENESS = 4
EXIT_MPS_FAILED = 5            # the MPS control daemon would not start; nothing else started
EXIT_MPS_DIED = 6              # the MPS control daemon died while the unit ran
EXIT_SERVICE_STOPPED = 69      # EX_UNAVAILABLE: a service exited 0 on its own
EXIT_DRAIN_INCOMPLETE = 75     # EX_TEMPFAIL: a requested stop lost in-flight work
EXIT_SETUP = 78                # EX_CONFIG: a port is taken (or a service could not start)
EXIT_SPAWN_FAILED = 127
EXIT_FORCED = 130              # a second SIGINT cut a requested stop short

CLEAN_STOP_CODES = frozenset({0, 128 + signal.SIGTERM})  # exited when told to, or by our SIGTERM

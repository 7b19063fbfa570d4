"""The sentinel: outlives a supervisor that was SIGKILLed just long enough to end what the
unit started.

PR_SET_PDEATHSIG reaches only the supervisor's direct children; a server that a service's
wrapper started in a new session would keep running, and keep the service's port, after
the supervisor died. The supervisor starts this small process (a bare interpreter: no
site, standard library only) before any service, holding the read end of a pipe whose
write end only the supervisor has. When the supervisor ends normally it writes ``done``
first and the sentinel exits at once; any other end of the pipe (EOF) means the supervisor
died, and the sentinel ends every process of the run (its cgroups, its environment marker)
and exits. It ignores the stop signals so that a Ctrl-C on the terminal cannot take it
first.

Run as: python -S -E -c "<bootstrap>" FD SPEC_JSON
"""

from __future__ import annotations

import json
import os
import signal
import sys

DONE = b"done"


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    fd, spec = int(argv[0]), json.loads(argv[1])
    got = b""
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        got += data
        if DONE in got:
            return 0
    from supervisor.system.containment import end_run
    end_run(spec)
    return 0


def bootstrap(root: str) -> str:
    """The -c program: the package from its own checkout, whatever the environment says."""
    return (f"import sys; sys.path.insert(0, {root!r}); from supervisor.system.sentinel import main; "
            f"sys.exit(main(sys.argv[1:]))")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Is a port free before a service is started on it, and who holds it when it is not.

Checked before anything is spawned, so that a port held by another process is a clear
setup error (exit 78) naming the port and, when the process table shows it, the holder,
instead of a supervisor that takes the other process's answers for its own service's.
The probes' identity check (driver/child_probe.py) covers the race after this check.
"""

from __future__ import annotations

import errno
import socket


def port_problem(host: str, port: int) -> str | None:
    """None when host:port can be bound now (as uvicorn binds it), else why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            holder = port_holder(port)
            return f"port {port} on {host} is taken" + (f" by {holder}" if holder else
                                                       " (its holder is not visible to this user)")
        return f"cannot bind {host}:{port}: {exc.strerror or exc}"
    finally:
        s.close()
    return None


def port_holder(port: int) -> str | None:
    """'pid N (cmdline)' of the process listening on port, when this user may see it."""
    import psutil

    from supervisor.config.redact import redact_argv
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                cmd = " ".join(redact_argv(psutil.Process(c.pid).cmdline()))[:120]
            except psutil.Error:
                cmd = "?"
            return f"pid {c.pid} ({cmd})"
    return None

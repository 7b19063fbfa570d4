"""A service process: `python -m services.runtime.serve`, started by the supervisor.

Everything it needs comes from the environment the supervisor built (see
supervisor/plan.py): the app factory (``ONECARD_SERVICE_APP``, "module:function"),
host, port, thread count, the service's own settings as JSON, its drain timeout
(``ONECARD_DRAIN_S``, below the supervisor's grace), its instance token and probe
socket. uvicorn serves the app through the guarded protocol (connection, header and
deadline limits) and drains in-flight requests on SIGTERM; /readyz turns 503 as soon
as the drain starts so that no new work is routed here.

Exit codes: 0 after a complete drain, 75 when the drain ran out of time and in-flight
work was cancelled, 78 (EX_CONFIG) when the service cannot start (the app cannot be
imported or built, its model will not load, its port is taken), 70 when the supervisor
disappeared.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import threading
import time
import traceback

EXIT_START_FAILED = 78  # EX_CONFIG
EXIT_PARENT_GONE = 70
EXIT_DRAIN_CUT = 75     # EX_TEMPFAIL: the drain ran out of time and in-flight work was cancelled


def watch_parent(period_s: float = 0.5) -> None:
    """Exit when the supervisor disappears (belt and braces next to PR_SET_PDEATHSIG)."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=loop, name="onecard-parent-watch", daemon=True).start()


def raise_open_files_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit: connections are capped by max_connections,
    not by a default soft limit of 1024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _seconds(env, *names: str, default: float) -> float:
    for name in names:
        try:
            return float(env[name])
        except (KeyError, ValueError):
            continue
    return default


def main() -> int:
    from services.runtime.threads import set_passive_waits
    set_passive_waits()
    env = os.environ
    name = env.get("ONECARD_SERVICE_NAME", "service")
    spec = env.get("ONECARD_SERVICE_APP")
    if not spec:
        print(f"{name}: ONECARD_SERVICE_APP is not set", file=sys.stderr)
        return EXIT_START_FAILED
    if env.get("ONECARD_SERVICE_WATCH_PARENT", "1") == "1":
        watch_parent()
    try:
        settings = json.loads(env.get("ONECARD_SERVICE_CONFIG") or "{}")
        app = load_factory(spec)(settings)
    except Exception as exc:  # noqa: BLE001 - any failure to build the app is a setup error
        from services.runtime.settings import StartupConfigError
        if isinstance(exc, StartupConfigError):  # the message says it all: a traceback would bury it
            print(f"{name}: configuration error: {exc}", file=sys.stderr, flush=True)
            return EXIT_START_FAILED
        print(f"{name}: cannot build the app {spec!r}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return EXIT_START_FAILED

    import uvicorn
    from services.runtime.protocol import ConnectionLimits, guarded_protocol

    fds = raise_open_files_limit()
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    limits_src = getattr(ctx, "settings", None)
    limits = ConnectionLimits(
        # open connections plus as many lingering refusals must fit under the descriptor limit
        max_connections=min(getattr(limits_src, "max_connections", 512), max(16, (fds - 64) // 2)),
        max_header_bytes=getattr(limits_src, "max_header_bytes", 16 * 1024),
        header_timeout_s=getattr(limits_src, "header_timeout_s", 10.0),
        body_timeout_s=getattr(limits_src, "body_timeout_s", 60.0),
    )
    config = uvicorn.Config(
        app,
        host=env.get("ONECARD_SERVICE_HOST", "127.0.0.1"),
        port=int(env.get("ONECARD_SERVICE_PORT", "8000")),
        log_level=env.get("ONECARD_LOG_LEVEL", "info"),
        access_log=False,  # the runtime's own request log (ONECARD_ACCESS_LOG=1) carries timings
        timeout_graceful_shutdown=_seconds(env, "ONECARD_DRAIN_S", "ONECARD_GRACE_S", default=8.0),
        timeout_keep_alive=getattr(limits_src, "keepalive_timeout_s", 5.0),
        lifespan="on",
        http=guarded_protocol(limits),
        backlog=min(2048, limits.max_connections * 2),
    )

    class Server(uvicorn.Server):
        drained = False

        def handle_exit(self, sig, frame):  # readiness goes 503 the moment the drain starts
            if ctx is not None:
                ctx.draining = True
            super().handle_exit(sig, frame)

        async def _wait_tasks_to_complete(self) -> None:
            await super()._wait_tasks_to_complete()
            self.drained = True  # not reached when the drain timeout cancels the wait

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            # uvicorn re-raises the signal it caught once it is done, so a clean drain would
            # look like death by SIGTERM (143); the exit code says how the drain went instead
            self._captured_signals.clear()

    server = Server(config)
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
    # A failed start-up (the model would not load, the port is taken) leaves started False:
    # exit with EX_CONFIG so that the supervisor's exit code says the service could not start.
    if not server.started:
        return EXIT_START_FAILED
    return 0 if server.drained else EXIT_DRAIN_CUT


if __name__ == "__main__":
    sys.exit(main())

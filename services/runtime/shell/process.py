"""A service process (``python -m services.runtime.serve``, as the supervisor starts it).

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

A drain that runs out ends the process by itself: a model call cannot be cancelled, and
the interpreter would wait for its executor thread at exit (for as long as the call
takes) until the supervisor's SIGKILL. So when in-flight work was cut the process
exits 75 at once, and a watchdog started by the stop signal exits 75 at the latest
``drain_s + min(1, drain_s / 2)`` after it, whatever is still running.

The shell (services.runtime.shell.app) puts the auth failure gate in front of its apps; an
ASGI app built without the shell is served behind one here, so the rate limit of
credential guessing holds for every service started by this module.
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


# glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
# after one big answer is freed the next ones come from the heap and are never given back:
# twenty 27 MB answers cut by the send deadline kept +490 MB of RSS for good. A fixed
# threshold keeps large blocks in their own mappings, returned to the system when freed.
MMAP_THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def fix_malloc_thresholds() -> bool:
    """Fixed glibc thresholds (unless the environment sets its own): big blocks are given
    back. False where there is no glibc (musl, macOS)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD))


# How long a thread may hold the GIL while another waits for it (CPython's default: 5 ms).
# The event loop (and the probes it answers) competes with the CPU pool's threads; each of
# those that runs Python or a C call that keeps the GIL makes the loop wait a whole interval,
# and with four of them it lost the race again and again: a 5 ms sleep overshot by 126 ms at
# p99 beside four threads parsing JSON and base64, 45 ms at 1 ms. The cost: at most a
# thousand forced switches a second.
GIL_SWITCH_S = 0.001


def set_gil_switch_interval(env=os.environ) -> float:
    try:
        seconds = float(env.get("ONECARD_GIL_SWITCH_MS", "")) / 1000
    except ValueError:
        seconds = GIL_SWITCH_S
    seconds = seconds if 0 < seconds <= 1 else GIL_SWITCH_S
    sys.setswitchinterval(seconds)
    return seconds


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


def drain_exit_margin(drain_s: float) -> float:
    """Time after the drain window for the app's shutdown before the watchdog ends it; below
    the supervisor's own margin (grace_s - drain_s, at least min(2, grace_s / 2))."""
    return min(1.0, drain_s / 2)


def hard_exit(code: int) -> None:
    """Exit now, without waiting for threads still running a model call."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def start_drain_watchdog(stop_requested: threading.Event, limit_s: float) -> None:
    def watch() -> None:
        stop_requested.wait()
        time.sleep(limit_s)
        print(f"{os.environ.get('ONECARD_SERVICE_NAME', 'service')}: still running {limit_s:g} s after the "
              f"stop signal; exiting {EXIT_DRAIN_CUT}", file=sys.stderr)
        hard_exit(EXIT_DRAIN_CUT)

    threading.Thread(target=watch, name="onecard-drain-watchdog", daemon=True).start()


def main() -> int:
    from services.runtime.device.threads import set_passive_waits
    set_passive_waits()
    fix_malloc_thresholds()
    set_gil_switch_interval()
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

    import asyncio

    import uvicorn

    from common.hostmemory import trim_heap
    from services.runtime.device.threads import raise_loop_priority
    from services.runtime.edge import turn_lane
    from services.runtime.edge.auth_failures import AuthFailureGate, FailureLimiter
    from services.runtime.edge.body_bytes import BodyBytes
    from services.runtime.edge.connection_limits import limits_from_settings
    from services.runtime.edge.door import Door
    from services.runtime.edge.metrics import EdgeCollector
    from services.runtime.edge.protocol import ConnectionStats, guarded_protocol
    from services.runtime.edge.send_deadline import KernelQueueLinger
    from services.runtime.shell.health_answer import HealthAnswer, answering_ahead, health_at_the_door

    fds = raise_open_files_limit()
    shell = getattr(getattr(app, "state", None), "shell", None)
    settings = getattr(shell, "settings", None)
    limits = limits_from_settings(settings, fds)
    linger = KernelQueueLinger(limits.send_timeout_s, limits.max_connections)
    def trim_on_a_worker() -> None:
        try:
            asyncio.get_running_loop().run_in_executor(None, trim_heap)
        except RuntimeError:  # the loop shutting down, its executor gone: no trim, no error in a callback
            pass
    bodies = BodyBytes(trim_on_a_worker, later=lambda delay, fn: asyncio.get_running_loop().call_later(delay, fn))
    if shell is not None:
        shell.metrics.registry.register(EdgeCollector(ConnectionStats, shell.limiter, linger, bodies))
        app = answering_ahead(app, shell)
    else:  # an ASGI app built without the shell: credential guessing is still slowed down
        app = AuthFailureGate(app, FailureLimiter(10, 60.0))
    drain_s = _seconds(env, "ONECARD_DRAIN_S", "ONECARD_GRACE_S", default=8.0)
    # answered at the door only where the route is answered ahead too (no middleware of the service's own)
    door_answer = health_at_the_door(shell) if isinstance(app, HealthAnswer) else None
    config = uvicorn.Config(
        app,
        host=env.get("ONECARD_SERVICE_HOST", "127.0.0.1"),
        port=int(env.get("ONECARD_SERVICE_PORT", "8000")),
        log_level=env.get("ONECARD_LOG_LEVEL", "info"),
        access_log=False,  # the shell's own request log (ONECARD_ACCESS_LOG=1) carries timings
        timeout_graceful_shutdown=drain_s,
        timeout_keep_alive=getattr(settings, "keepalive_timeout_s", 5.0),
        lifespan="on",
        http=guarded_protocol(limits, linger=linger, probe_answer=door_answer, bodies=bodies),
        ws="none",  # no route takes a WebSocket; an installed library must not bypass the guarded protocol
        backlog=min(2048, limits.max_connections * 2),
    )
    stop_requested = threading.Event()
    start_drain_watchdog(stop_requested, drain_s + drain_exit_margin(drain_s))

    class Server(uvicorn.Server):
        drained = False
        door: Door | None = None

        async def serve(self, sockets=None) -> None:
            # the loop's queue of callbacks is replaced before any thread of the app's could hand it one
            turn_lane.install(asyncio.get_running_loop(), lambda: None)
            await super().serve(sockets)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            door = Door(asyncio.get_running_loop(), ConnectionStats, door_answer)
            # (over TLS the door would hand on connections without the server's context)
            if self.started and not config.ssl and door.open(self.servers):
                self.door = door
                # probes between a long turn's callbacks (the lane itself went in before the app's threads started)
                if not turn_lane.install(asyncio.get_running_loop(), door.look):
                    print(f"{name}: this event loop is not asyncio's own; probes wait for each turn's end",
                          file=sys.stderr)

        def handle_exit(self, sig, frame):  # readiness goes 503 the moment the drain starts
            if not self.started and not self.should_exit:
                # still starting (a model warming up): no port is open, nothing was taken, so
                # there is nothing to drain. Waiting for the warm-up spent the whole drain and
                # ended in 75, "work lost", for a pod deleted while it started
                print(f"{name}: stop signal during start-up; nothing was taken; exiting 0", file=sys.stderr)
                hard_exit(0)
            if shell is not None:
                shell.begin_drain()
            stop_requested.set()  # only flags: the watchdog thread does the waiting
            super().handle_exit(sig, frame)

        async def _wait_tasks_to_complete(self) -> None:
            await super()._wait_tasks_to_complete()
            self.drained = True  # not reached when the drain timeout cancels the wait

        async def shutdown(self, sockets=None) -> None:
            if self.door is not None:  # no newcomer from here, as the servers' own close does
                self.door.close()
            await super().shutdown(sockets)
            # uvicorn re-raises the signal it caught once it is done, so a clean drain would
            # look like death by SIGTERM (143); the exit code says how the drain went instead
            self._captured_signals.clear()

    raise_loop_priority()  # this thread runs the event loop
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
    if not server.drained:
        # in-flight work was cancelled, but a model call keeps its thread: do not wait for it
        hard_exit(EXIT_DRAIN_CUT)
    return 0

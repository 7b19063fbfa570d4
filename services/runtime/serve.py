"""A service process: `python -m services.runtime.serve`, started by the supervisor.

Everything it needs comes from the environment the supervisor built (see
supervisor/plan.py): the app factory (``ONECARD_SERVICE_APP``, "module:function"),
host, port, thread count and the service's own settings as JSON. The factory is
called with those settings and returns an ASGI app; uvicorn serves it and drains
in-flight requests on SIGTERM.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time


EXIT_START_FAILED = 78  # EX_CONFIG


def watch_parent(period_s: float = 0.5) -> None:
    """Exit when the supervisor disappears (belt and braces next to PR_SET_PDEATHSIG)."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                os._exit(70)

    threading.Thread(target=loop, name="onecard-parent-watch", daemon=True).start()


def load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def main() -> int:
    import uvicorn

    env = os.environ
    name = env.get("ONECARD_SERVICE_NAME", "service")
    spec = env.get("ONECARD_SERVICE_APP")
    if not spec:
        print(f"{name}: ONECARD_SERVICE_APP is not set", file=sys.stderr)
        return 2
    settings = json.loads(env.get("ONECARD_SERVICE_CONFIG") or "{}")
    if env.get("ONECARD_SERVICE_WATCH_PARENT", "1") == "1":
        watch_parent()
    app = load_factory(spec)(settings)
    config = uvicorn.Config(
        app,
        host=env.get("ONECARD_SERVICE_HOST", "127.0.0.1"),
        port=int(env.get("ONECARD_SERVICE_PORT", "8000")),
        log_level=env.get("ONECARD_LOG_LEVEL", "info"),
        access_log=env.get("ONECARD_ACCESS_LOG", "0") == "1",
        timeout_graceful_shutdown=float(env.get("ONECARD_GRACE_S", "10")),
        lifespan="on",
        http="httptools",
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except SystemExit:
        if server.started:
            raise
    # A failed start-up (the model would not load, the port is taken) leaves started False:
    # exit with EX_CONFIG so that the supervisor's exit code says the service could not start.
    return 0 if server.started else EXIT_START_FAILED


if __name__ == "__main__":
    sys.exit(main())

"""A tiny ASGI service for driving the supervisor in tests, with no ML library.

Behaviour comes from its settings (the service's config section):
  startup_delay_s   sleep this long in the lifespan before /readyz turns 200
  never_ready       /readyz always 503
  crash_after_s     os._exit(crash_code) this long after start-up
  crash_code        exit code for crash_after_s and /crash (default 3)
  hang_after_s      block the event loop for good this long after start-up
  ignore_sigterm    ignore SIGTERM once started (so only SIGKILL stops it)
  orphan            start a grandchild that detaches and lingers orphan_s seconds
Routes: /healthz /readyz /stats /pid /slow?s=S /crash?code=N|signal=N /hang
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from urllib.parse import parse_qs


def create_app(settings: dict):
    state = {"ready": False, "served": 0, "in_flight": 0}

    def _later(loop, delay, fn):
        loop.call_later(float(delay), fn)

    async def lifespan(receive, send):
        msg = await receive()
        assert msg["type"] == "lifespan.startup"
        await asyncio.sleep(float(settings.get("startup_delay_s", 0)))
        loop = asyncio.get_running_loop()
        if "crash_after_s" in settings:
            _later(loop, settings["crash_after_s"], lambda: os._exit(int(settings.get("crash_code", 3))))
        if "hang_after_s" in settings:
            _later(loop, settings["hang_after_s"], lambda: time.sleep(10**6))
        if settings.get("ignore_sigterm"):
            # after uvicorn installed its own handlers
            _later(loop, 0.0, lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
        if settings.get("orphan"):
            code = ("import os,time,sys\n"
                    "if os.fork(): os._exit(0)\n"
                    f"time.sleep({float(settings.get('orphan_s', 0.5))})\n")
            subprocess.Popen([sys.executable, "-c", code]).wait()
        state["ready"] = not settings.get("never_ready", False)
        await send({"type": "lifespan.startup.complete"})
        msg = await receive()
        await send({"type": "lifespan.shutdown.complete"})

    async def respond(send, status, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        path = scope["path"]
        q = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        if path == "/healthz":
            return await respond(send, 200, {"status": "ok"})
        if path == "/readyz":
            return await respond(send, 200 if state["ready"] else 503, {"ready": state["ready"]})
        if path == "/stats":
            return await respond(send, 200, {"served": state["served"], "in_flight": state["in_flight"],
                                             "queue_depth": 0, "latency_p50_ms": 1.5, "latency_p99_ms": 2.5})
        if path == "/pid":
            return await respond(send, 200, {"pid": os.getpid()})
        if path == "/slow":
            state["in_flight"] += 1
            try:
                await asyncio.sleep(float(q.get("s", "1")))
            finally:
                state["in_flight"] -= 1
            state["served"] += 1
            return await respond(send, 200, {"slept": float(q.get("s", "1")), "pid": os.getpid()})
        if path == "/crash":
            await respond(send, 200, {"crashing": True})
            if "signal" in q:
                os.kill(os.getpid(), int(q["signal"]))
            os._exit(int(q.get("code", settings.get("crash_code", 3))))
        if path == "/hang":
            time.sleep(10**6)
        return await respond(send, 404, {"error": "not found"})

    return app

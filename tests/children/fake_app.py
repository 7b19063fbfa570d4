"""A tiny ASGI service for driving the supervisor in tests, with no ML library.

It follows the runtime's contract with the supervisor: /healthz, /readyz and /stats answer
JSON with ``"instance"`` (ONECARD_INSTANCE_TOKEN) and ``"pid"``, and an
``X-Onecard-Instance`` header; the same three paths are also served on the unix socket
ONECARD_PROBE_SOCKET when it is set (a small asyncio server on the app's own loop, so a
hung loop hangs both); SIGTERM drains in-flight requests for at most ONECARD_DRAIN_S and
the process exits 75 on its own when the drain runs out, as the runtime does.

Behaviour comes from its settings (the service's config section):
  startup_delay_s   sleep this long in the lifespan before /readyz turns 200
  never_ready       /readyz always 503
  crash_after_s     os._exit(crash_code) this long after start-up
  crash_code        exit code for crash_after_s and /crash (default 3)
  hang_after_s      block the event loop for good this long after start-up
  ignore_sigterm    ignore SIGTERM once started (so only SIGKILL stops it)
  orphan            start a grandchild that detaches and lingers orphan_s seconds
  anonymous         answer probes without instance or pid (like a process that is not ours)
  chatter_lines_s   print this many lines a second, forever (log pressure)
  tcp_probes_fail   probes on the TCP port answer 503 (only the unix probe socket tells the truth)
  jobs              a dict passed through in /stats as "jobs"
Routes: /healthz /readyz /stats /pid /slow?s=S /crash?code=N|signal=N /hang /ready?on=0|1
        /exit?code=N (clean exit after the response) /burn?s=S (CPU in a short-lived child)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import parse_qs

EXIT_DRAIN_CUT = 75


def create_app(settings: dict):
    state = {"ready": False, "served": 0, "in_flight": 0, "ready_override": None}
    token = os.environ.get("ONECARD_INSTANCE_TOKEN", "")
    anonymous = bool(settings.get("anonymous"))
    drain_s = float(os.environ.get("ONECARD_DRAIN_S") or os.environ.get("ONECARD_GRACE_S") or 10)

    def identity() -> dict:
        return {} if anonymous else {"instance": token, "pid": os.getpid()}

    def probe(path: str) -> tuple[int, dict] | None:
        if path == "/healthz":
            return 200, {"status": "ok", **identity()}
        if path == "/readyz":
            ready = state["ready"] if state["ready_override"] is None else state["ready_override"]
            return (200 if ready else 503), {"ready": ready, **identity()}
        if path == "/stats":
            return 200, {"served": state["served"], "in_flight": state["in_flight"], "queue_depth": 0,
                         "latency_p50_ms": 1.5, "latency_p99_ms": 2.5, **identity(),
                         **({"jobs": settings["jobs"]} if isinstance(settings.get("jobs"), dict) else {})}
        return None

    def headers(data: bytes, ctype: str = "application/json") -> list:
        out = [(b"content-type", ctype.encode()), (b"content-length", str(len(data)).encode())]
        if not anonymous:
            out.append((b"x-onecard-instance", token.encode()))
        return out

    async def serve_probe_socket(path: str):
        async def handle(reader, writer):
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                target = head.split(b" ", 2)[1].decode().split("?", 1)[0]
                found = probe(target) or (404, {"error": "not found"})
                data = json.dumps(found[1]).encode()
                lines = [f"HTTP/1.1 {found[0]} X", "Connection: close"] + [
                    f"{k.decode()}: {v.decode()}" for k, v in headers(data)]
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
                await writer.drain()
            except Exception:  # noqa: BLE001 - a probe client that went away
                pass
            finally:
                writer.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return await asyncio.start_unix_server(handle, path=path)

    def _later(loop, delay, fn):
        loop.call_later(float(delay), fn)

    def watch_drain():
        """Wrap uvicorn's SIGTERM handler: the drain ends on time, as the runtime's does."""
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(sig, frame):
            def cut():
                time.sleep(drain_s)
                print(f"drain of {drain_s:g} s ran out with {state['in_flight']} requests in flight", flush=True)
                os._exit(EXIT_DRAIN_CUT)
            threading.Thread(target=cut, daemon=True).start()
            if callable(previous):
                previous(sig, frame)
        signal.signal(signal.SIGTERM, on_term)

    def chatter(rate: float):
        def loop():
            i = 0
            while True:
                print(f"chatter {i} " + "x" * 200, flush=True)
                i += 1
                time.sleep(1.0 / rate)
        threading.Thread(target=loop, daemon=True).start()

    async def lifespan(receive, send):
        msg = await receive()
        assert msg["type"] == "lifespan.startup"
        probe_server = None
        if os.environ.get("ONECARD_PROBE_SOCKET"):
            probe_server = await serve_probe_socket(os.environ["ONECARD_PROBE_SOCKET"])
        await asyncio.sleep(float(settings.get("startup_delay_s", 0)))
        loop = asyncio.get_running_loop()
        if "crash_after_s" in settings:
            _later(loop, settings["crash_after_s"], lambda: os._exit(int(settings.get("crash_code", 3))))
        if "hang_after_s" in settings:
            _later(loop, settings["hang_after_s"], lambda: time.sleep(10**6))
        # after uvicorn installed its own handlers
        if settings.get("ignore_sigterm"):
            _later(loop, 0.0, lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
        else:
            _later(loop, 0.0, watch_drain)
        if settings.get("chatter_lines_s"):
            chatter(float(settings["chatter_lines_s"]))
        if settings.get("orphan"):
            code = ("import os,time,sys\n"
                    "if os.fork(): os._exit(0)\n"
                    f"time.sleep({float(settings.get('orphan_s', 0.5))})\n")
            subprocess.Popen([sys.executable, "-c", code]).wait()
        state["ready"] = not settings.get("never_ready", False)
        await send({"type": "lifespan.startup.complete"})
        msg = await receive()
        if probe_server is not None:
            probe_server.close()
        await send({"type": "lifespan.shutdown.complete"})

    async def respond(send, status, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": headers(data, ctype)})
        await send({"type": "http.response.body", "body": data})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        path = scope["path"]
        q = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        found = probe(path)
        if found is not None:
            if settings.get("tcp_probes_fail"):
                return await respond(send, 503, {"error": "probe me on the unix socket", **identity()})
            return await respond(send, *found)
        if path == "/pid":
            return await respond(send, 200, {"pid": os.getpid()})
        if path == "/ready":
            state["ready_override"] = q.get("on", "1") == "1"
            return await respond(send, 200, {"ready": state["ready_override"]})
        if path == "/slow":
            state["in_flight"] += 1
            try:
                await asyncio.sleep(float(q.get("s", "1")))
            finally:
                state["in_flight"] -= 1
            state["served"] += 1
            return await respond(send, 200, {"slept": float(q.get("s", "1")), "pid": os.getpid()})
        if path == "/burn":
            code = f"import time\nt=time.process_time()\nwhile time.process_time()-t<{float(q.get('s', '0.5'))}: pass"
            await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code])
            return await respond(send, 200, {"burned": True})
        if path == "/exit":
            await respond(send, 200, {"exiting": True})
            asyncio.get_running_loop().call_later(0.05, os._exit, int(q.get("code", "0")))
            return None
        if path == "/crash":
            await respond(send, 200, {"crashing": True})
            if "signal" in q:
                os.kill(os.getpid(), int(q["signal"]))
            os._exit(int(q.get("code", settings.get("crash_code", 3))))
        if path == "/hang":
            time.sleep(10**6)
        return await respond(send, 404, {"error": "not found"})

    return app

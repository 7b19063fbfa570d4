"""The scripted service (tests.children.scripted_app) plus routes for the HTTP edge tests.

GET /big?mb=N answers N MiB built for that request (its own memory, as an encoded
image would be); GET /stream?mb=N sends N MiB a piece of 256 KiB at a time, each once the
client took the last (as a job's result is sent); GET /wait?s=S answers after S seconds of awaiting (no model, no
thread); GET /whoami answers the client address the app sees; POST /late_read?s=S reads
its body only after S seconds (as a service that admits a request before reading it);
GET /until_disconnect?s=S&tag=T waits up to S seconds for its client to leave, and says in
DISCONNECTS[T] whether it was told (in-process tests read it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.children.scripted_app import create_app as create_scripted_app

DISCONNECTS: dict[str, bool] = {}


def create_app(settings: dict[str, Any]) -> FastAPI:
    app = create_scripted_app(settings)

    @app.get("/big")
    async def big(mb: float = 1.0):
        return Response(b"\x01" * int(mb * 2**20), media_type="application/octet-stream")

    @app.get("/stream")
    async def stream(mb: float = 1.0):
        async def pieces():
            for _ in range(int(mb * 4)):
                yield b"\x02" * 2**18
        return StreamingResponse(pieces(), media_type="application/octet-stream")

    @app.get("/wait")
    async def wait(s: float = 1.0, tag: str = ""):
        await asyncio.sleep(s)
        return {"waited": s, "tag": tag}

    @app.get("/until_disconnect")
    async def until_disconnect(request: Request, s: float = 2.0, tag: str = ""):
        try:
            async with asyncio.timeout(s):
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            DISCONNECTS[tag] = True
        except TimeoutError:
            DISCONNECTS[tag] = False
        return {"tag": tag}

    @app.post("/late_read")
    async def late_read(request: Request, s: float = 1.0):
        await asyncio.sleep(s)
        return {"bytes": len(await request.body())}

    return app

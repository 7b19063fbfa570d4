"""A scripted onecard-like model service for the jobs tests, with no ML library: it answers
what the jobs service reads of a real one (/readyz, /info with limits, /openapi.json) and
POST /api/v1/work, whose JSON body scripts the answer:

  tag          a name the call log records
  sleep_s      work this long (a client that disconnects meanwhile is logged, as the
               runtime's scheduler notices it)
  status       answer this HTTP status instead of 200 (with the error envelope and code)
  code         the error code for that status
  retry_after  Retry-After header for that status
  times        only the first N calls with this tag get `status`; later ones succeed
  pad          answer this many more bytes (a "pad" string in the JSON answer)
  binary       answer this many bytes of image/png-typed noise instead of JSON (seeded by the tag)
  chunked      send the answer in pieces without a Content-Length
  crash        exit at once (os._exit) when the call starts, as a model that kills its process

Settings: model (the model name in /info), batch (max_batch_size), dry_run (honour
X-Onecard-Dry-Run: validate, answer {"valid": true}, never work), cost (the dry run also
answers cost.output_bytes: pad or binary plus 200), max_body_bytes (in /info), journal (a file where every event is
appended as "event tag" lines: it outlives a restart of the process), unit (echoed back),
openapi (false: no /openapi.json, as a service that publishes none), openapi_failures (the
first N fetches of /openapi.json answer 503, as a service still starting or overloaded).
GET /calls shows the log: started, finished, disconnected, dry_runs (tags, in order), and
traceparents: [tag, the call's traceparent header or null] for every call that started.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random


def create_app(settings: dict):
    log = {"started": [], "finished": [], "disconnected": [], "dry_runs": [], "traceparents": []}
    seen: collections.Counter[str] = collections.Counter()
    name = os.environ.get("ONECARD_SERVICE_NAME", "scripted")

    def record(event: str, tag) -> None:
        log[event].append(tag)
        if settings.get("journal"):
            with open(settings["journal"], "a") as f:
                f.write(f"{event} {tag}\n")

    async def respond(send, status, doc, headers=()):
        data = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": data})

    async def read_body(receive) -> bytes:
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ConnectionError
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return b"".join(chunks)

    def error(status, code, message):
        return status, {"error": {"code": code, "message": message}}

    def validate(doc) -> tuple[int, dict] | None:
        if not isinstance(doc, dict):
            return error(422, "invalid_parameter", "body: expected a JSON object")
        sleep_s = doc.get("sleep_s", 0)
        if not isinstance(sleep_s, (int, float)) or sleep_s < 0:
            return error(422, "invalid_parameter", "sleep_s: expected a number >= 0")
        return None

    async def work(scope, receive, send):
        try:
            doc = json.loads(await read_body(receive) or b"null")
        except ValueError:
            return await respond(send, *error(400, "bad_json", "the body is not valid JSON"))
        except ConnectionError:
            return
        bad = validate(doc)
        dry = any(k == b"x-onecard-dry-run" and v == b"1" for k, v in scope["headers"])
        if dry and settings.get("dry_run"):
            record("dry_runs", doc.get("tag") if isinstance(doc, dict) else None)
            answer = {"valid": True, "items": 1}
            if settings.get("cost") and not bad:
                answer["cost"] = {"output_bytes": int(doc.get("pad") or doc.get("binary") or 0) + 200}
            return await respond(send, *(bad or (200, answer)))
        if bad:
            return await respond(send, *bad)
        tag = str(doc.get("tag", ""))
        seen[tag] += 1
        record("started", tag)
        log["traceparents"].append([tag, next((v.decode() for k, v in scope["headers"] if k == b"traceparent"), None)])
        if doc.get("crash"):
            os._exit(3)
        status = int(doc.get("status", 200))
        if status != 200 and seen[tag] <= int(doc.get("times", 10**9)):
            headers = [(b"retry-after", str(doc["retry_after"]).encode())] if "retry_after" in doc else []
            record("finished", tag)
            return await respond(send, *error(status, doc.get("code", "scripted"), f"scripted {status}"), headers)
        sleeper = asyncio.ensure_future(asyncio.sleep(float(doc.get("sleep_s", 0))))
        gone = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({sleeper, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone in done and not sleeper.done():
            sleeper.cancel()
            record("disconnected", tag)
            return
        gone.cancel()
        record("finished", tag)
        if doc.get("binary"):
            data = random.Random(tag).randbytes(int(doc["binary"]))
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"image/png"), (b"content-length", str(len(data)).encode()),
                (b"x-seed", b"42")]})
            return await send({"type": "http.response.body", "body": data})
        answer = {"tag": tag, "unit": settings.get("unit"), "pid": os.getpid()}
        if doc.get("pad"):
            answer["pad"] = "x" * int(doc["pad"])
        if not doc.get("chunked"):
            return await respond(send, 200, answer)
        data = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        for i in range(0, len(data), 65536):
            await send({"type": "http.response.body", "body": data[i:i + 65536], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    info = {"service": name, "backend": "scripted", "model": settings.get("model", "m1"),
            "limits": {"max_batch_size": int(settings.get("batch", 1)), "max_queue": 8,
                       "max_body_bytes": int(settings.get("max_body_bytes", 1_000_000)), "max_pixels": 1_000_000}}
    json_body = {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    openapi = {"openapi": "3.1.0", "paths": {"/api/v1/work": {"post": {"requestBody": json_body}},
                                             "/api/v1/reset": {"post": {}}, "/calls": {"get": {}}}}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        path = scope["path"]
        if path in ("/healthz", "/readyz"):
            return await respond(send, 200, {"status": "ok"})
        if path == "/info":
            return await respond(send, 200, info)
        if path == "/openapi.json" and settings.get("openapi", True):
            seen["/openapi.json"] += 1
            if seen["/openapi.json"] <= int(settings.get("openapi_failures", 0)):
                return await respond(send, *error(503, "overloaded", "try again"))
            return await respond(send, 200, openapi)
        if path == "/calls":
            return await respond(send, 200, log)
        if path == "/api/v1/work" and scope["method"] == "POST":
            return await work(scope, receive, send)
        return await respond(send, *error(404, "not_found", path))

    return app

"""A model service written only with the public API (``import onecard``), as a user writes
one, for the tests that check it gets what the built-in services get.

POST /api/v1/tint (a picture; params: tag, sleep, mode): the model sleeps `sleep` per call
(the longest asked), records every call's tags in order, reports progress, stops between
50 ms steps when every item is cancelled. mode "bad" fails that item alone (422), "boom"
raises from decode, "exit" calls sys.exit() in decode, "quit" raises KeyboardInterrupt in
predict, "pixels-exit" calls sys.exit() in item_pixels. The answer: the picture's mean color
and size (JSON), or the picture
itself with ?answer=image (format from Accept). POST /api/v1/words (text/plain or JSON
{"text": ...}): a second model route without pictures. GET /record: what the model saw;
GET /modules?prefix=P: the modules this process has imported under P. POST /spawn: a sleeper in
a session of its own. POST /hoard?mib=N: N MiB kept for good (a leak).
POST /notes (JSON): a plain route that reads and parses its body with the Service's helpers.
Settings: its own `greeting` key besides onecard's.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from pydantic import Field
from starlette.requests import Request as HttpRequest

import onecard


class TintSettings(onecard.Settings):
    greeting: str = Field("hello", max_length=64, description="what /api/v1/words answers with")


class TintParams(onecard.Params):
    tag: onecard.Str = ""
    sleep: onecard.Float = Field(0.0, ge=0, le=30)
    mode: onecard.Str = ""
    answer: onecard.Str = "json"


class Tint(onecard.Model):
    """Mean color of a picture."""

    batching = True
    cancellable = True
    Settings = TintSettings
    Params = TintParams
    settings: TintSettings

    def setup(self, ctx: onecard.Setup) -> None:
        self.calls: list[list[str]] = []
        self.stopped: list[str] = []
        self.device_seen = ctx.device

    def warmup_inputs(self) -> list[dict]:
        return [{"tag": "warmup", "rgb": np.zeros((8, 8, 3), np.uint8), "sleep": 0.0, "mode": ""}]

    def decode_request(self, request: onecard.Request) -> dict[str, Any]:
        p = request.params()
        if p.mode == "boom":
            raise KeyError("unexpected")
        if p.mode == "exit":
            sys.exit(3)
        rgb = request.image()
        request.state.answer = p.answer
        return {"tag": p.tag, "rgb": rgb, "sleep": p.sleep, "mode": p.mode}

    def item_pixels(self, item: dict) -> int:
        if item.get("mode") == "pixels-exit":  # (called on the event loop)
            sys.exit(5)
        return onecard.Model.item_pixels(self, item["rgb"]) if "rgb" in item else 0

    def predict(self, items: list[dict], call: onecard.Call) -> list[Any]:
        tags = [i["tag"] for i in items]
        if tags != ["warmup"] * len(tags):
            self.calls.append(tags)
        if any(i["mode"] == "quit" for i in items):
            raise KeyboardInterrupt("quit")
        steps = int(max(i["sleep"] for i in items) / 0.05)
        for step in range(steps):
            if call.cancelled():
                self.stopped.extend(tags)
                call.check()
            call.progress(step, steps)
            time.sleep(0.05)
        out: list[Any] = []
        for i, item in enumerate(items):
            if item["mode"] == "bad":
                out.append(onecard.Error(422, "bad_item", f"item {item['tag']} is bad"))
            elif "rgb" in item:
                out.append({"tag": item["tag"], "mean": [round(float(v), 2) for v in item["rgb"].mean(axis=(0, 1))],
                            "batch": len(items), "cancelled": call.cancelled(i)})
            else:
                out.append({"words": item["text"].split(), "batch": len(items)})
        return out

    def encode_response(self, output: dict, request: onecard.Request) -> Any:
        if request.state.answer == "image":
            return onecard.image(np.full((4, 4, 3), [int(v) for v in output["mean"]], np.uint8))
        return output

    def batch_key(self, item: dict) -> Any:
        return "rgb" in item

    def info(self) -> dict[str, Any]:
        return {"model_name": "tint-1"}

    def add_routes(self, service: onecard.Service) -> None:
        def decode_words(request: onecard.Request) -> dict:
            text = request.json().get("text", "") if request.content_type == "application/json" else request.text()
            if not isinstance(text, str) or not text:
                raise onecard.Error(422, "invalid_parameter", "text: expected a non-empty string")
            request.cost(items=1)
            return {"tag": "words", "text": text, "sleep": 0.0, "mode": ""}

        def encode_words(output: dict, request: onecard.Request) -> dict:
            return {**output, "greeting": self.settings.greeting}

        service.add_route(onecard.Route("/api/v1/words", decode_words, encode_words, image_fields=(),
                                        summary="Split text into words"))

        @service.app.get("/record")
        async def record() -> dict[str, Any]:
            return {"calls": self.calls, "stopped": self.stopped, "device": self.device_seen}

        @service.app.post("/notes")
        async def notes(request: HttpRequest) -> dict[str, Any]:
            body = await service.read_body(request)
            doc = await service.run_cpu(service.parse_json, body)
            return {"keys": len(doc) if isinstance(doc, dict) else None}

        hoard: list[bytearray] = []

        @service.app.post("/hoard")
        async def hoard_memory(mib: int) -> dict[str, int]:
            """Memory kept for good, as a leaking model keeps it (touched: resident)."""
            hoard.append(bytearray(b"\x01") * (mib * 2**20))
            return {"kept_mib": sum(len(b) for b in hoard) // 2**20}

        @service.app.post("/spawn")
        async def spawn() -> dict[str, int]:
            """A process that leaves the service's session and outlives it unless stopped."""
            import subprocess
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
            return {"pid": child.pid}

        @service.app.get("/modules")
        async def modules(prefix: str) -> list[str]:
            """What this process has imported under ``prefix`` (the traces tests: nothing of
            opentelemetry unless traces are on)."""
            return sorted(m for m in list(sys.modules) if m == prefix or m.startswith(prefix + "."))


create_app = onecard.serve(Tint, route="/api/v1/tint")

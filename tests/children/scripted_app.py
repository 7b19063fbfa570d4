"""A service on the real runtime with a scripted model, for admission/batching/fault tests.

POST /api/v1/echo?id=X&sleep=S&mode=M[&key=K&items=N&cancellable=1&decode_sleep=D] with an
image body; GET /block?s=S stalls the event loop on purpose. The backend sleeps S seconds per
batch (the longest asked; POST /release wakes the one sleeping now), records every id it sees
(GET /seen), and per mode: "bad" fails that item alone (422), "oom" raises
CUDA's OOM text for the batch, "torch_oom" raises torch.cuda.OutOfMemoryError, "boom"
raises an unexpected error in decode, "hang" blocks the model. `key` sets the batching
key (items with different keys never share a batch), `items` makes the request bring N
items, `cancellable=1` gives items a cancel event that the model checks every 50 ms
(like diffusion steps; stopped ids are recorded), `decode_sleep` holds the decode hook.

Settings (besides the runtime's): batching (bool), warmup_sleep_s (each warm-up
inference sleeps this long), warmup_oom_above (a warm-up batch of more items fails with
onnxruntime's arena out-of-memory text), fail_load (raise in load), memory_per_pixel (the backend's
stated memory floor: a model call is planned at this many bytes per pixel of its items;
an item's pixels are its picture's).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

import onecard
from services.runtime.codecs.params import Bool, Float, Int, Params, Str
from services.runtime.errors import ApiError
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.model_routes import ModelRoute, Work, json_reply
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.shell.model_part import model_service_app


class EchoParams(Params):
    id: Str = ""
    sleep: Float = 0.0
    mode: Str = ""
    key: Str = ""
    items: Int = 1
    cancellable: Bool = False
    decode_sleep: Float = 0.0
    stated: Bool = True   # False: the hook states no cost and reads only the header (the items' cost is charged)
    max_side: Int = 0     # the item's long side (request.image(max_side=)): its cost is that size's


@dataclass(eq=False)
class EchoItem:
    id: str
    sleep: float
    mode: str
    cancel: threading.Event | None = None
    pixels: int = 0


@dataclass
class Record:
    seen: list[str] = field(default_factory=list)
    batches: list[list[str]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    warmups: int = 0
    freed: int = 0


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self, batching: bool, warmup_sleep_s: float, fail_load: bool, warmup_oom_above: int = 0):
        self.supports_batching = batching
        self.warmup_sleep_s = warmup_sleep_s
        self.release = threading.Event()  # POST /release: the batch sleeping now wakes
        self.warmup_oom_above = warmup_oom_above
        self.fail_load = fail_load
        self.record = Record()

    def load(self) -> None:
        if self.fail_load:
            raise RuntimeError("scripted load failure")

    def warmup_items(self) -> list[Any]:
        return [EchoItem("warmup", self.warmup_sleep_s, "")]

    def item_pixels(self, item: EchoItem) -> int:
        return item.pixels

    def infer_batch(self, items: list[EchoItem]) -> list[Any]:
        ids = [i.id for i in items]
        if all(i == "warmup" for i in ids):  # warm-up, and the cost curve measured on it
            if self.warmup_oom_above and len(ids) > self.warmup_oom_above:
                raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running "
                                   "Conv node. Status Message: bfc_arena.cc:360 Available memory of 41601536 is "
                                   "smaller than requested bytes of 157286400")
            time.sleep(items[0].sleep)
            self.record.warmups += 1
            return [{"id": "warmup", "batch": len(ids)} for _ in ids]
        self.record.seen.extend(ids)
        self.record.batches.append(ids)
        if any(i.mode == "oom" for i in items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if any(i.mode == "torch_oom" for i in items):
            import torch  # torch's own error class, as a CUDA allocation failure raises it
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        longest = max(i.sleep for i in items)
        stopped = False
        if any(i.mode == "hang" for i in items):
            time.sleep(longest or 5)
        elif all(i.cancel is not None for i in items):
            t_end = time.monotonic() + longest
            while time.monotonic() < t_end:          # "steps" of 50 ms
                if all(i.cancel.is_set() for i in items):
                    self.record.stopped.extend(ids)
                    stopped = True
                    break
                time.sleep(0.05)
        elif self.release.wait(longest):  # a hold the test ends when it has done what it held for
            self.release.clear()
        return [ApiError(422, "bad_item", f"item {i.id} is bad") if i.mode == "bad"
                else {"id": i.id, "batch": len(items), "stopped": stopped} for i in items]

    def on_out_of_memory(self) -> None:
        self.record.freed += 1

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "model": "scripted", "device": "cpu"}


def create_app(settings: dict[str, Any]) -> FastAPI:
    settings = dict(settings)
    batching = bool(settings.pop("batching", False))
    warmup_sleep_s = float(settings.pop("warmup_sleep_s", 0.0))
    fail_load = bool(settings.pop("fail_load", False))
    warmup_oom_above = int(settings.pop("warmup_oom_above", 0))
    memory_per_pixel = float(settings.pop("memory_per_pixel", 0.0))
    cfg = ModelServiceSettings.model_validate(settings)
    backend = ScriptedBackend(batching, warmup_sleep_s, fail_load, warmup_oom_above)
    backend.memory_per_pixel = memory_per_pixel

    def decode(raw) -> Work:
        request = onecard.Request(raw, cfg, ("image",), EchoParams)  # the input forms, as every service reads them
        p = request.params()
        if p.stated:
            request.image(max_side=p.max_side or None)
        header = request.image_header()
        if p.mode == "boom":
            raise KeyError("unexpected")
        if p.decode_sleep:
            time.sleep(p.decode_sleep)
        items = [EchoItem(p.id if p.items == 1 else f"{p.id}.{n}", p.sleep, p.mode,
                          threading.Event() if p.cancellable else None, header.pixels)
                 for n in range(p.items)]
        return Work(items, p.key or None, header.width)

    def encode(work: Work, results: list[Any], raw) -> Any:
        out = results[0] if len(results) == 1 else {"id": [r["id"] for r in results], "batch": results[0]["batch"]}
        return json_reply({**out, "width": work.state})

    def add_routes(app: FastAPI, part, shell) -> None:
        part.pipeline.add(app, ModelRoute("/api/v1/echo", decode, encode, summary="echo"))

        @app.get("/block")
        async def block(s: float = 1.0):
            time.sleep(s)  # deliberately stalls the event loop: /healthz must notice
            return {"blocked": s}

        ran: list[float] = []

        @app.get("/long_turn")
        async def long_turn(n: int = 60, ms: float = 1.0):
            """n callbacks of the next loop turn, each keeping the loop ms (deliberately): a turn
            of n x ms; /long_turn/ran says when each ended (CLOCK_MONOTONIC, as other processes')."""
            ran.clear()

            def busy() -> None:
                end = time.monotonic() + ms / 1000
                while time.monotonic() < end:
                    pass
                ran.append(time.monotonic())
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, lambda: [loop.call_soon(busy) for _ in range(n)])
            return {"scheduled": n}

        @app.get("/long_turn/ran")
        async def long_turn_ran():
            return {"ran": ran}

        @app.post("/release")
        async def release():
            backend.release.set()
            return {"released": True}

        @app.get("/seen")
        async def seen():
            r = backend.record
            return {"seen": r.seen, "batches": r.batches, "stopped": r.stopped, "warmups": r.warmups,
                    "freed": r.freed}

    return model_service_app("scripted", cfg, backend, add_routes, title="scripted")

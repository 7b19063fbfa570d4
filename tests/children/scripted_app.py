"""A service on the real runtime with a scripted model, for admission/batching/fault tests.

POST /api/v1/echo?id=X&sleep=S&mode=M with an image body. The backend sleeps S
seconds per batch (the longest asked), records every id it sees (GET /seen), and
per mode: "bad" fails that item alone (ValueError), "oom" raises CUDA's OOM text for
the batch, "torch_oom" raises torch.cuda.OutOfMemoryError, "boom" raises an unexpected error in the route, "hang" blocks the model.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request

from services.runtime.app import ServiceContext, create_service_app
from services.runtime.backend import Backend
from services.runtime.codec import Timing
from services.runtime.errors import ApiError
from services.runtime.settings import RuntimeSettings


class ScriptedBackend(Backend):
    name = "scripted"

    def __init__(self, batching: bool):
        self.supports_batching = batching
        self.seen: list[str] = []
        self.batches: list[list[str]] = []
        self.freed = 0

    def load(self) -> None:
        pass

    def warmup_items(self) -> list[Any]:
        return [{"id": "warmup", "sleep": 0.0, "mode": ""}]

    def infer_batch(self, items: list[dict]) -> list[Any]:
        ids = [i["id"] for i in items]
        if ids != ["warmup"]:
            self.seen.extend(ids)
            self.batches.append(ids)
        if any(i["mode"] == "oom" for i in items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if any(i["mode"] == "torch_oom" for i in items):
            import torch  # torch's own error class, as a CUDA allocation failure raises it
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if any(i["mode"] == "hang" for i in items):
            time.sleep(max(i["sleep"] for i in items) or 5)
        else:
            time.sleep(max(i["sleep"] for i in items))
        return [ValueError(f"item {i['id']} is bad") if i["mode"] == "bad" else {"id": i["id"], "batch": len(items)}
                for i in items]

    def on_out_of_memory(self) -> None:
        self.freed += 1


def create_app(settings: dict[str, Any]) -> FastAPI:
    batching = bool(settings.pop("batching", False))
    cfg = RuntimeSettings.model_validate(settings)
    backend = ScriptedBackend(batching)

    def add_routes(app: FastAPI, ctx: ServiceContext) -> None:
        @app.post("/api/v1/echo")
        async def echo(request: Request, id: str = "", sleep: float = 0.0, mode: str = ""):
            timing = Timing()
            img = await ctx.read_image(request, timing)
            if mode == "boom":
                raise KeyError("unexpected")
            try:
                out = await ctx.infer(request, {"id": id, "sleep": sleep, "mode": mode}, timing)
            except ValueError as exc:
                raise ApiError(422, "bad_item", str(exc)) from None
            return ctx.json({**out, "width": img.image.width}, timing)

        @app.get("/seen")
        async def seen():
            return {"seen": backend.seen, "batches": backend.batches, "freed": backend.freed}

    return create_service_app("scripted", cfg, backend, add_routes, title="scripted")

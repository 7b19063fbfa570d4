"""A simulated accelerator: a service on onecard's own runtime whose model call takes what a
batch costs on a real card, ``A + B (b - 1)`` seconds for b items, sleeping (no CPU used, as
a GPU leaves the CPU idle), with real decode of the uploaded JPEG and a real encode of the
answer in the CPU pool. To the scheduler it looks like the card: a call that takes
A + B(b - 1) while the CPU idles.

Profiles (A, B in seconds):
  sd15-h100   0.643  0.0644   SD-1.5 img2img fp16 512x512 on an H100 (1 image 643 ms, 8 in 1094 ms)
  sd-alt      0.250  0.045    another sub-linear curve
  detector    0.008  0.0015   a face detector on a GPU
  linear      0.200  0.200    a CPU-like model: b items cost b times one

Run it in a unit like any service: ``app = "bench.simaccel:create_app"`` with settings
``{"profile": "sd15-h100"}`` (or ``"a_s"``/``"b_s"``), ``"answer": "png" | "json"``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic import Field

from services.runtime.shell.model_part import model_service_app
from services.runtime.pipeline.backend import Backend
from services.runtime.codecs.images import encode_image
from services.runtime.pipeline.image_input import read_image_input
from services.runtime.codecs.params import Params
from services.runtime.pipeline.model_routes import ModelRoute, Reply, Work, json_reply
from services.runtime.pipeline.settings import ModelServiceSettings

PROFILES = {"sd15-h100": (0.643, 0.0644), "sd-alt": (0.250, 0.045), "detector": (0.008, 0.0015),
            "linear": (0.200, 0.200)}
SIDE = 512


@dataclass(eq=False)
class SimItem:
    rgb: np.ndarray


class SimParams(Params):
    pass


class SimSettings(ModelServiceSettings):
    profile: str = Field("sd15-h100", pattern="^(sd15-h100|sd-alt|detector|linear|custom)$")
    a_s: float | None = Field(None, ge=0, le=60, allow_inf_nan=False)
    b_s: float | None = Field(None, ge=0, le=60, allow_inf_nan=False)
    answer: str | None = Field(None, pattern="^(png|json)$", description="default: json for the detector, else png")


class SimulatedAccelerator(Backend):
    name = "simaccel"
    supports_batching = True

    def __init__(self, a_s: float, b_s: float):
        self.a_s, self.b_s = a_s, b_s
        self.calls: list[int] = []
        self.events: list[tuple] = []

    def load(self) -> None:
        pass

    def warmup_items(self) -> list[Any]:
        return [SimItem(np.full((SIDE, SIDE, 3), 128, np.uint8))]

    def item_pixels(self, item: SimItem) -> int:
        return SIDE * SIDE          # the model runs at a fixed size, whatever is uploaded

    def item_work(self, item: SimItem) -> float:
        return 1.0

    def infer_batch(self, items: list[SimItem]) -> list[Any]:
        t0 = time.perf_counter()
        time.sleep(self.a_s + self.b_s * (len(items) - 1))
        self.calls.append(len(items))
        self.events.append(("call", t0, time.perf_counter(), len(items)))
        return [item.rgb for item in items]

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "model": f"A={self.a_s}s B={self.b_s}s", "device": "simulated"}


def create_app(settings: dict[str, Any]) -> FastAPI:
    cfg = SimSettings.model_validate(settings)
    a, b = PROFILES.get(cfg.profile, (0.1, 0.1))
    backend = SimulatedAccelerator(cfg.a_s if cfg.a_s is not None else a, cfg.b_s if cfg.b_s is not None else b)

    def decode(raw) -> Work:
        t0 = time.perf_counter()
        got = read_image_input(raw, cfg, params=SimParams)
        backend.events.append(("decode", t0, time.perf_counter()))
        return Work([SimItem(got.image.rgb)], None)

    def encode(work: Work, results: list[Any], raw) -> Reply:
        t0 = time.perf_counter()
        if (cfg.answer or ("json" if cfg.profile == "detector" else "png")) == "json":
            return json_reply({"shape": list(results[0].shape)})
        data, mime = encode_image(results[0], "png")
        backend.events.append(("encode", t0, time.perf_counter()))
        return Reply(data, mime)

    def add_routes(app: FastAPI, part, shell) -> None:
        part.pipeline.add(app, ModelRoute("/api/v1/sim", decode, encode, summary="simulated accelerator"))

        @app.get("/calls")
        async def calls() -> dict[str, Any]:
            sizes = backend.calls[-2000:]
            return {"calls": len(backend.calls), "recent_sizes": sizes, "events": backend.events[-400:]}

    return model_service_app(os.environ.get("ONECARD_SERVICE_NAME", "simaccel"), cfg, backend, add_routes,
                              title="onecard simulated accelerator")

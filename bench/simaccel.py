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

import time
from typing import Any

import numpy as np
from pydantic import Field

import onecard

PROFILES = {"sd15-h100": (0.643, 0.0644), "sd-alt": (0.250, 0.045), "detector": (0.008, 0.0015),
            "linear": (0.200, 0.200)}
SIDE = 512


class SimParams(onecard.Params):
    pass


class SimSettings(onecard.Settings):
    profile: str = Field("sd15-h100", pattern="^(sd15-h100|sd-alt|detector|linear|custom)$")
    a_s: float | None = Field(None, ge=0, le=60, allow_inf_nan=False)
    b_s: float | None = Field(None, ge=0, le=60, allow_inf_nan=False)
    answer: str | None = Field(None, pattern="^(png|json)$", description="default: json for the detector, else png")


class SimulatedAccelerator(onecard.Model):
    """A model call that takes A + B (b - 1) seconds for b items, sleeping."""

    name = "simaccel"
    batching = True
    Settings = SimSettings
    Params = SimParams
    settings: SimSettings

    def setup(self, ctx: onecard.Setup) -> None:
        a, b = PROFILES.get(self.settings.profile, (0.1, 0.1))
        self.a_s = self.settings.a_s if self.settings.a_s is not None else a
        self.b_s = self.settings.b_s if self.settings.b_s is not None else b
        self.calls: list[int] = []
        self.events: list[tuple] = []
        self.device = "simulated"

    def warmup_inputs(self) -> list[np.ndarray]:
        return [np.full((SIDE, SIDE, 3), 128, np.uint8)]

    def item_pixels(self, item: np.ndarray) -> int:
        return SIDE * SIDE          # the model runs at a fixed size, whatever is uploaded

    def item_work(self, item: np.ndarray) -> float:
        return 1.0

    def decode_request(self, request: onecard.Request) -> np.ndarray:
        t0 = time.perf_counter()
        request.params()
        rgb = request.image()
        self.events.append(("decode", t0, time.perf_counter()))
        return rgb

    def predict(self, items: list[np.ndarray], call: onecard.Call) -> list[np.ndarray]:
        t0 = time.perf_counter()
        time.sleep(self.a_s + self.b_s * (len(items) - 1))
        self.calls.append(len(items))
        self.events.append(("call", t0, time.perf_counter(), len(items)))
        return list(items)

    def encode_response(self, rgb: np.ndarray, request: onecard.Request) -> Any:
        t0 = time.perf_counter()
        cfg = self.settings
        if (cfg.answer or ("json" if cfg.profile == "detector" else "png")) == "json":
            return {"shape": list(rgb.shape)}
        data, mime = onecard.encode_image(rgb, "png")
        self.events.append(("encode", t0, time.perf_counter()))
        return onecard.Response(data, mime)

    def info(self) -> dict[str, Any]:
        return {"model": f"A={self.a_s}s B={self.b_s}s"}

    def add_routes(self, service: onecard.Service) -> None:
        @service.app.get("/calls")
        async def calls() -> dict[str, Any]:
            sizes = self.calls[-2000:]
            return {"calls": len(self.calls), "recent_sizes": sizes, "events": self.events[-400:]}


create_app = onecard.serve(SimulatedAccelerator, route="/api/v1/sim", title="onecard simulated accelerator",
                           summary="simulated accelerator")

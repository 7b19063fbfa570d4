"""A model service's settings: what every service shares (services.runtime.settings) plus
the pipeline's keys: the queue, batching, deadlines, memory budgets, input limits, the
decode/encode pool and the device. Public as ``onecard.Settings``; a service's own
settings class extends it with its keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.runtime.settings import ServiceSettings


class ModelServiceSettings(ServiceSettings):
    # ---- queueing, batching, deadlines -------------------------------------------------
    max_queue: int = Field(32, ge=0, le=100_000,
                           description="admitted requests not yet on the model (decoding or waiting); beyond: 503")
    max_batch_size: int = Field(8, ge=1, le=256, description="items run together in one model call")
    batch_policy: Literal["auto", "fixed"] = Field(
        "auto", description="auto: when the model frees up, wait for more items only when the measured batch-cost "
                            "curve and what is arriving say it serves the requests better (never for a model whose "
                            "cost grows linearly with the batch); fixed: wait max_wait_ms from the oldest item's "
                            "arrival, or until the batch is full")
    max_wait_ms: float | None = Field(None, ge=0, le=10_000, allow_inf_nan=False,
                                      description="auto: the longest the oldest item may wait for a batch to fill "
                                                  "(default: one call's fixed cost, as measured); fixed: the fill "
                                                  "window (default 0: take what is queued when the model frees up)")
    request_timeout_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False,
                                     description="deadline from arrival: not started by then, 504 and never run")
    inference_timeout_s: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False,
                                       description="a model call running longer fails /healthz")
    warmup_runs: int = Field(2, ge=0, le=100, description="real inferences before /readyz turns 200")

    # ---- memory: what a request, a model call and the service may hold ------------------
    memory_budget_bytes: int | None = Field(
        None, ge=64 * 2**20, le=2**50,
        description="host memory the whole service may use; default: the supervisor's plan, else "
                    "memory_budget_fraction of the container's memory limit (or of the machine's RAM)")
    memory_budget_fraction: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False,
        description="share of the memory limit when neither memory_budget_bytes nor the supervisor's plan says "
                    "(default 0.3)")
    max_call_memory_bytes: int | None = Field(
        None, ge=2**20, le=2**50,
        description="working memory one model call may use (on a GPU: the planned GPU budget minus the weights); "
                    "default: half of what the service budget leaves after load and warm-up. Batches are formed "
                    "to fit; an item that alone does not fit gets 413")
    max_held_bytes: int | None = Field(
        None, ge=2**20, le=2**50,
        description="what admitted requests may hold together (bodies, decoded pictures, results, answers until "
                    "read); default: what the service budget leaves after load, warm-up and one model call. A "
                    "request that does not fit waits its turn (first come, first served) until its deadline, then "
                    "503 memory_busy")
    max_request_bytes: int | None = Field(
        None, ge=2**20, le=2**50,
        description="what one request may hold at its peak (body, decoded pictures, results, the encoded answer "
                    "until it is read); default: half of what admitted requests may hold together. Over: 413")

    # ---- input limits ------------------------------------------------------------------
    max_pixels: int = Field(40_000_000, ge=1, le=2**31,
                            description="larger images get 413 (read from the header before decoding)")
    max_jpeg_scans: int = Field(32, ge=1, le=10_000,
                                description="JPEGs with more scans (progressive passes) get 413 before decoding")
    max_image_markers: int = Field(512, ge=8, le=100_000,
                                   description="JPEGs with more header segments get 413 before decoding")
    max_fields: int = Field(64, ge=1, le=10_000, description="multipart parts or JSON object keys at the top level")

    # ---- threads, device, identity -------------------------------------------------------
    cpu_workers: int | None = Field(None, ge=1, le=256,
                                    description="threads for decode/encode; default: twice the service's planned "
                                                "threads, at least 4 (one big picture must not hold the pool for "
                                                "everyone)")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="'auto', 'cpu' or 'cuda'")
    model_label: str | None = Field(None, max_length=200, pattern=r"^[\w.\-/:]+$",
                                    description="label of the loaded model (default service/backend/model)")

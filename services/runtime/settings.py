"""Settings every service shares; a service's own settings model extends this one.

Every limit the runtime enforces has a key here, with the default a production user
would expect; the README's limits table is written from these descriptions.
"""

from __future__ import annotations

import os

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StartupConfigError(Exception):
    """A setting that cannot work in this environment (a variable it names is missing): the
    service does not start, and services.runtime.serve prints this message alone (no
    traceback) and exits 78 (EX_CONFIG), like any service that cannot start."""


class RuntimeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

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
    retry_after_s: int = Field(1, ge=0, le=3600, description="Retry-After on 503")

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
    max_request_bytes: int | None = Field(
        None, ge=2**20, le=2**50,
        description="what one request may hold at its peak (body, decoded pictures, results, the encoded answer "
                    "until it is read); default: half of what admitted requests may hold together. Over: 413")

    # ---- input limits ------------------------------------------------------------------
    max_body_bytes: int = Field(20 * 2**20, ge=1024, le=2**31, description="larger bodies get 413")
    max_pixels: int = Field(40_000_000, ge=1, le=2**31,
                            description="larger images get 413 (read from the header before decoding)")
    max_jpeg_scans: int = Field(32, ge=1, le=10_000,
                                description="JPEGs with more scans (progressive passes) get 413 before decoding")
    max_image_markers: int = Field(512, ge=8, le=100_000,
                                   description="JPEGs with more header segments get 413 before decoding")
    max_json_depth: int = Field(32, ge=2, le=1000, description="deeper JSON bodies get 400")
    max_fields: int = Field(64, ge=1, le=10_000, description="multipart parts or JSON object keys at the top level")

    # ---- connections and protocol ------------------------------------------------------
    max_connections: int = Field(512, ge=1, le=1_000_000,
                                 description="open client connections; beyond, new ones get 503 and are closed")
    max_header_bytes: int = Field(16 * 1024, ge=1024, le=2**20,
                                  description="request line plus headers; beyond: 431 and the connection is closed")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False,
                                    description="time to receive a request's line and headers once it started; then 408")
    body_timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False,
                                  description="time to receive a whole request body; then 408")
    keepalive_timeout_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False,
                                       description="an idle kept-alive connection is closed after this")
    send_timeout_s: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False,
                                  description="a client that takes none of its answer for this long (nginx's "
                                  "send_timeout) is reset and the buffered answer freed")
    max_header_count: int = Field(100, ge=8, le=10_000,
                                  description="header fields in one request; beyond: 431 and the connection is closed")
    max_pipelined_requests: int = Field(16, ge=1, le=1024,
                                        description="requests queued behind the one being answered on a connection; "
                                        "beyond: 429 after the earlier answers, and the connection is closed")
    auth_max_failures: int = Field(10, ge=0, le=1_000_000,
                                   description="failed credential checks per client address within "
                                   "auth_failure_window_s; beyond: 429 with Retry-After (0: no limit)")
    auth_failure_window_s: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False,
                                         description="the window over which auth_max_failures is counted")
    loop_stall_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False,
                                description="/healthz fails when the event loop has not run for this long")

    # ---- threads -----------------------------------------------------------------------
    cpu_workers: int | None = Field(None, ge=1, le=256,
                                    description="threads for decode/encode; default: twice the service's planned threads, "
                                                "at least 4 (one big picture must not hold the pool for everyone)")

    # ---- auth, device, identity ----------------------------------------------------------
    api_key: str | None = Field(None, description="require this key (Bearer or X-API-Key)", repr=False)
    api_key_env: str | None = Field(None, description="...or read the key from this environment variable")
    basic_auth_env: str | None = Field(None, description="HTTP Basic: an environment variable holding user:password pairs (comma-separated)")
    basic_auth_file: str | None = Field(None, description="HTTP Basic: a file of user:password pairs (one a line)")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="'auto', 'cpu' or 'cuda'")
    model_label: str | None = Field(None, max_length=200, pattern=r"^[\w.\-/:]+$",
                                    description="label of the loaded model (default service/backend/model)")

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None

"""Settings every service shares; a service's own settings model extends this one."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field


class RuntimeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    max_queue: int = Field(32, ge=0, le=100_000, description="requests waiting beyond this get 503")
    max_batch_size: int = Field(8, ge=1, le=256, description="requests run together on the model")
    max_wait_ms: float = Field(0.0, ge=0, le=10_000, description="how long a batch waits to fill up; 0: take what is queued when the model frees up")
    request_timeout_s: float = Field(30.0, gt=0, le=3600, description="deadline: past it, 504, work not started")
    inference_timeout_s: float = Field(60.0, gt=0, le=86400, description="a model call running longer fails /healthz")
    max_body_bytes: int = Field(20 * 2**20, ge=1024, description="larger bodies get 413")
    max_pixels: int = Field(40_000_000, ge=1, description="larger images get 413 (checked from the header)")
    warmup_runs: int = Field(2, ge=0, le=100, description="real inferences before /readyz turns 200")
    retry_after_s: int = Field(1, ge=0, le=3600, description="Retry-After on 503")
    api_key: str | None = Field(None, description="require this key (Bearer or X-API-Key)")
    api_key_env: str | None = Field(None, description="...or read the key from this environment variable")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda'")

    def resolved_api_key(self) -> str | None:
        if self.api_key:
            return self.api_key
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or None
        return None

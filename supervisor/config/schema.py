"""The configuration's shape, validated with pydantic: the services, and the whole file.

The supervisor's and the GPU's sections are plain dataclasses (settings.py) that pydantic
validates here as parts of `Config`. Imported by the command line only: the long-running
supervisor process never imports pydantic.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from supervisor.config.settings import GpuSettings, SupervisorSettings

SERVICE_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
APP_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServiceSettings(_Strict):
    app: str | None = Field(None, description="ASGI app factory, 'module:function'")
    command: list[str] | None = Field(None, description="full command line instead of app")
    host: str = "127.0.0.1"
    port: int = Field(..., ge=1, le=65535)
    threads: int | Literal["auto"] = Field("auto", description="CPU threads for the service's libraries")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    settings: dict[str, Any] = Field(default_factory=dict, description="the service's own section")
    enabled: bool = True
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1, description="GPU memory budget, share of the card")
    gpu_memory_bytes: int | None = Field(None, gt=0, description="GPU memory budget in bytes")
    memory_fraction: float | None = Field(None, gt=0, le=1, description="host memory budget, share of the unit's "
                                          "memory limit (default: an equal share of what the others leave)")
    memory_bytes: int | None = Field(None, gt=0, description="host memory budget in bytes")
    mps_thread_percentage: int | None = Field(None, ge=1, le=100,
                                              description="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE under MPS")
    drain_s: float | None = Field(None, gt=0, le=3600, description="this service's drain timeout "
                                  "(default: supervisor.drain_s)")

    @field_validator("app")
    @classmethod
    def _app_shape(cls, v: str | None) -> str | None:
        if v is not None and not APP_RE.fullmatch(v):
            raise ValueError("expected 'package.module:factory'")
        return v

    @field_validator("command")
    @classmethod
    def _command_shape(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0]):
            raise ValueError("expected a non-empty list of arguments")
        return v

    @field_validator("threads")
    @classmethod
    def _threads_positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("expected a whole number >= 1 or \"auto\"")
        return v

    @model_validator(mode="after")
    def _one_launcher(self) -> ServiceSettings:
        if (self.app is None) == (self.command is None):
            raise ValueError("set exactly one of 'app' and 'command'")
        if self.gpu_memory_fraction is not None and self.gpu_memory_bytes is not None:
            raise ValueError("set at most one of 'gpu_memory_fraction' and 'gpu_memory_bytes'")
        if self.memory_fraction is not None and self.memory_bytes is not None:
            raise ValueError("set at most one of 'memory_fraction' and 'memory_bytes'")
        return self


class Config(_Strict):
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    services: dict[str, ServiceSettings] = Field(default_factory=dict)

    @field_validator("services")
    @classmethod
    def _names(cls, v: dict[str, ServiceSettings]) -> dict[str, ServiceSettings]:
        for name in v:
            if not SERVICE_NAME_RE.match(name):
                raise ValueError(f"service name {name!r}: expected lower-case letters, digits, '-' or '_'")
        return v

    def enabled_services(self) -> dict[str, ServiceSettings]:
        return {n: s for n, s in self.services.items() if s.enabled}


"""The img2img service's settings: the runtime's, plus the backend and its model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

import onecard

SCHEDULERS = ("default", "ddim", "euler", "euler_a", "dpmpp_2m", "lms", "pndm", "heun", "unipc")


class Img2ImgSettings(onecard.Settings):
    max_batch_size: int = Field(8, ge=1, le=64,
                                description="compatible requests run as one pipeline call of up to this many images")
    request_timeout_s: float = Field(120.0, gt=0, le=3600, allow_inf_nan=False)
    inference_timeout_s: float = Field(300.0, gt=0, le=86400, allow_inf_nan=False)
    backend: Literal["style", "diffusers"] = "style"
    max_side: int = Field(1024, ge=64, le=4096, description="long side the input is resized to")
    model_path: str | None = Field(None, description="diffusers: a local Stable Diffusion model directory")
    scheduler: Literal[SCHEDULERS] = Field("default", description="diffusers: the sampler")
    safety_checker: bool = Field(False, description="diffusers: run the model's safety checker if it has one")
    dtype: Literal["auto", "float16", "float32"] = Field("auto", description="auto: float16 on CUDA, float32 on CPU")
    default_steps: int = Field(20, ge=1, le=150)
    max_steps: int = Field(100, ge=1, le=1000)
    max_prompt_chars: int = Field(2000, ge=1, le=100_000)
    max_images: int = Field(16, ge=1, le=256, description="webui: batch_size x n_iter per request at most")
    max_option_keys: int = Field(256, ge=0, le=100_000,
                                 description="webui settings this service does not use, kept at most (413 beyond)")
    max_option_value_bytes: int = Field(64 * 1024, ge=16, le=2**30,
                                        description="webui: one such setting's JSON size at most (413 beyond)")
    max_options_bytes: int = Field(2**20, ge=4096, le=2**30,
                                   description="webui: the whole settings document's JSON size at most, and the "
                                               "largest POST /sdapi/v1/options body (413 beyond)")
    max_info_chars: int = Field(2**20, ge=1024, le=2**30,
                                description="webui png-info: metadata text answered at most (longer text is cut)")
    default_format: Literal["png", "jpeg", "webp"] = Field("png",
                                                           description="output format when the client names none")

    @model_validator(mode="after")
    def _diffusers_needs_a_model(self) -> Img2ImgSettings:
        if self.backend == "diffusers" and not self.model_path:
            raise ValueError("backend 'diffusers' needs model_path (a local model directory)")
        return self

SERVICE_SETTINGS = Img2ImgSettings

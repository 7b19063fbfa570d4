"""What every webui route answers, for the OpenAPI document: the 200 bodies (the webui's
own response models, as its API publishes them) and the webui's error shape."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import onecard
from onecard import Error


class _Out(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


class State(_Out):
    skipped: bool
    interrupted: bool
    stopping_generation: bool
    job: str
    job_count: int
    job_timestamp: str
    job_no: int
    sampling_step: int
    sampling_steps: int


class ProgressResponse(_Out):
    progress: float = Field(description="0 to 1")
    eta_relative: float = Field(description="seconds left, estimated")
    state: State
    current_image: str | None = Field(None, description="the preview, base64 PNG")
    textinfo: str | None = None


class GenerationResponse(_Out):
    images: list[str] = Field(description="base64 pictures in the samples_format option's format")
    parameters: dict[str, Any] = Field(description="the request's declared fields")
    info: str = Field(description="a JSON document: the webui's generation info")


class ExtrasSingleImageResponse(_Out):
    html_info: str
    image: str = Field(description="base64 picture")


class ExtrasBatchImagesResponse(_Out):
    html_info: str
    images: list[str] = Field(description="base64 pictures, in the order sent")


class PNGInfoResponse(_Out):
    info: str = Field(description="the infotext ('' when the picture has none)")
    items: dict[str, Any] = Field(description="the picture's other metadata")
    parameters: dict[str, Any] = Field(description="the infotext parsed as the webui parses it")


class SDModelItem(_Out):
    title: str
    model_name: str
    hash: str | None
    sha256: str | None
    filename: str
    config: str | None


class SamplerItem(_Out):
    name: str
    aliases: list[str]
    options: dict[str, Any]


class SchedulerItem(_Out):
    name: str
    label: str
    aliases: list[str] | None
    default_rho: float | None
    need_inner_model: bool | None


class UpscalerItem(_Out):
    name: str
    model_name: str | None
    model_path: str | None
    model_url: str | None
    scale: float | None


class MemoryResponse(_Out):
    ram: dict[str, Any]
    cuda: dict[str, Any]


class EmbeddingsResponse(_Out):
    loaded: dict[str, Any]
    skipped: dict[str, Any]


class ScriptsList(_Out):
    txt2img: list[str]
    img2img: list[str]


class Options(_Out):
    """The settings: the keys this service applies, and any other a client stored."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    sd_model_checkpoint: str
    samples_format: str
    jpeg_quality: int
    enable_pnginfo: bool
    img2img_fix_steps: bool
    show_progress_every_n_steps: int
    live_previews_enable: bool


class CmdFlags(_Out):
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    api: bool
    api_auth: str | None
    nowebui: bool


EMPTY_OBJECT = {"type": "object", "maxProperties": 0}
NULL = {"type": "null"}
ANY_ARRAY = {"type": "array", "items": {"type": "object"}}
SDAPI_ERROR_SCHEMA = {
    "title": "WebuiError", "type": "object", "required": ["error", "detail", "body", "errors"],
    "properties": {"error": {"type": "string", "description": "a stable code"},
                   "detail": {"type": "string", "description": "for people: names the field or the limit"},
                   "body": {"type": "string"}, "errors": {"type": "string", "description": "'status: detail'"}}}


def schema(body: type[BaseModel] | dict[str, Any], array: bool = False) -> dict[str, Any]:
    out = onecard.openapi_schema(body, mode="serialization") if isinstance(body, type) else body
    return {"type": "array", "items": out} if array else out


def sdapi_errors(statuses: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    content = {"application/json": {"schema": SDAPI_ERROR_SCHEMA}}
    described = {**Error.STATUSES, 404: "not found (a sampler, an unknown path)"}
    return {s: {"description": described[s], "content": content} for s in statuses}


def responses(body: type[BaseModel] | dict[str, Any], description: str, *, array: bool = False,
              errors: tuple[int, ...] = (500, 503)) -> dict[int, dict[str, Any]]:
    """OpenAPI responses of a webui route: its 200 body and its errors in the webui's shape."""
    return {200: {"description": description, "content": {"application/json": {"schema": schema(body, array)}}},
            **sdapi_errors(errors)}

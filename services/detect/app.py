"""The face-detection service: POST /api/v1/facedetect."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.detect.backends import BACKENDS, DetectItem
from services.detect.settings import DetectSettings
from services.runtime.app import ServiceContext, create_service_app
from services.runtime.codec import Timing
from services.runtime.errors import ApiError


class DetectParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_score: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False)
    max_faces: int | None = Field(None, ge=1, le=10_000)


def _params(query: dict[str, Any], body: dict[str, Any]) -> DetectParams:
    merged = {**query, **body}
    try:
        return DetectParams.model_validate(merged)
    except ValidationError as exc:
        e = exc.errors()[0]
        field = ".".join(str(p) for p in e["loc"]) or "request"
        raise ApiError(422, "invalid_parameter", f"{field}: {e['msg']}") from None


def add_routes(app: FastAPI, ctx: ServiceContext) -> None:
    @app.post("/api/v1/facedetect", summary="Detect faces",
              openapi_extra={"requestBody": {"content": {
                  "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
                  "image/png": {"schema": {"type": "string", "format": "binary"}},
                  "application/json": {"schema": {"type": "object", "required": ["image"], "properties": {
                      "image": {"type": "string", "description": "base64"},
                      "min_score": {"type": "number"}, "max_faces": {"type": "integer"}}}},
                  "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
                      "image": {"type": "string", "format": "binary"}}}}}, "required": True}})
    async def facedetect(request: Request) -> Any:
        timing = Timing()
        img = await ctx.read_image(request, timing)
        params = _params(dict(request.query_params), img.params)
        faces = await ctx.infer(request, DetectItem(img.image.rgb, params.min_score, params.max_faces), timing)
        return ctx.json({"faces": faces, "width": img.image.width, "height": img.image.height}, timing)


def create_app(settings: dict[str, Any]) -> FastAPI:
    cfg = DetectSettings.model_validate(settings)
    backend = BACKENDS[cfg.backend](cfg)
    return create_service_app(os.environ.get("ONECARD_SERVICE_NAME", "detect"), cfg, backend, add_routes,
                              title="onecard face detection")

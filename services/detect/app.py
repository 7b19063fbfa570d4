"""The face-detection service: POST /api/v1/facedetect, on the runtime's pipeline.

decode: the image (any of the three input forms; a large JPEG is decoded at reduced
scale when the backend shrinks it anyway) and the parameters. encode: faces in the
original image's pixel coordinates, as JSON.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from pydantic import Field

from services.detect.backends import BACKENDS, DetectItem
from services.detect.settings import DetectSettings
from services.runtime.shell.model_part import model_service_app
from services.runtime.pipeline.raw_request import RawRequest
from services.runtime.pipeline.image_input import read_image_input
from services.runtime.codecs.params import Float, Int, Params, inline_schema, query_parameters
from services.runtime.pipeline.model_routes import ModelRoute, Reply, Work, json_reply

BINARY = {"schema": {"type": "string", "format": "binary"}}


class DetectParams(Params):
    min_score: Float = Field(0.5, ge=0.0, le=1.0, description="faces scoring lower are left out")
    max_faces: Int | None = Field(None, ge=1, le=10_000, description="at most this many, the highest scores first")


class Face(Params):
    box: list[float] = Field(..., description="[x1, y1, x2, y2] in the original image's pixels")
    score: float
    landmarks: list[list[float]] = Field(..., description="five [x, y] points (eyes, nose, mouth corners); "
                                                          "empty for backends without landmarks")


class DetectResult(Params):
    faces: list[Face]
    width: int = Field(..., description="the image's width, after EXIF orientation")
    height: int


class DetectJsonBody(DetectParams):
    image: str = Field(..., description="the image, base64 (a data: URL prefix is allowed)")


def _map_back(face: dict[str, Any], scale: float, width: int, height: int) -> dict[str, Any]:
    if scale == 1.0:
        return face
    inv = 1.0 / scale
    x1, y1, x2, y2 = (v * inv for v in face["box"])
    return {"box": [round(min(max(x1, 0), width), 1), round(min(max(y1, 0), height), 1),
                    round(min(max(x2, 0), width), 1), round(min(max(y2, 0), height), 1)],
            "score": face["score"],
            "landmarks": [[round(x * inv, 1), round(y * inv, 1)] for x, y in face["landmarks"]]}


def detect_route(cfg: DetectSettings, shrinks_to: int | None) -> ModelRoute:
    def decode(raw: RawRequest) -> Work:
        got = read_image_input(raw, cfg, max_side=shrinks_to, params=DetectParams)
        params = got.params
        img = got.image
        return Work([DetectItem(img.rgb, params.min_score, params.max_faces)], None, img)

    def encode(work: Work, results: list[Any], raw: RawRequest) -> Reply:
        img = work.state
        faces = [_map_back(f, img.scale, img.width, img.height) for f in results[0]]
        return json_reply({"faces": faces, "width": img.width, "height": img.height})

    return ModelRoute(
        "/api/v1/facedetect", decode, encode, summary="Detect faces", tags=["detect"],
        description="Send the image as a raw body (`image/jpeg`, `image/png`, `image/webp`, `image/bmp`), "
                    "as a multipart field `image`, or as base64 in JSON. Parameters go in the query string, "
                    "the form or the JSON object.",
        parameters=query_parameters(DetectParams),
        request_body={"required": True, "content": {
            "image/jpeg": BINARY, "image/png": BINARY, "image/webp": BINARY, "image/bmp": BINARY,
            "application/json": {"schema": inline_schema(DetectJsonBody)},
            "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
                "image": {"type": "string", "format": "binary"},
                "min_score": {"type": "number"}, "max_faces": {"type": "integer"}}}}}},
        responses={200: {"description": "the faces found",
                         "content": {"application/json": {"schema": inline_schema(DetectResult, mode="serialization")}}}},
    )


def create_app(settings: dict[str, Any]) -> FastAPI:
    cfg = DetectSettings.model_validate(settings)
    backend = BACKENDS[cfg.backend](cfg)
    shrinks_to = cfg.max_side if cfg.backend in ("centerface", "insightface") else None

    def add_routes(app: FastAPI, part, shell) -> None:
        part.pipeline.add(app, detect_route(cfg, shrinks_to))

    return model_service_app(os.environ.get("ONECARD_SERVICE_NAME", "detect"), cfg, backend, add_routes,
                              title="onecard face detection")

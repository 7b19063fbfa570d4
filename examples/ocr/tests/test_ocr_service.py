"""The OCR service reads back text rendered with Pillow, in the three input forms, and says
what is wrong with a bad request. Run from examples/ocr: ``pytest tests``."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

from onecard.testing import ServiceProcess, assert_error

pytest.importorskip("rapidocr_onnxruntime")
HERE = Path(__file__).resolve().parent.parent


def page(lines: list[str], size: int = 36, fmt: str = "PNG") -> bytes:
    img = Image.new("RGB", (720, 60 + 70 * len(lines)), "white")
    draw = ImageDraw.Draw(img)
    for n, line in enumerate(lines):
        draw.text((30, 30 + 70 * n), line, fill=(20, 20, 20), font=ImageFont.load_default(size=size))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def ocr():
    with ServiceProcess("ocr_service.app:create_app", {"warmup_runs": 1}, name="ocr", pythonpath=[HERE]) as svc:
        yield svc


def lines(text: str) -> list[str]:
    """The lines read, upper-case, without spaces (the recogniser does not always keep them)."""
    return [line.upper().replace(" ", "") for line in text.split("\n") if line.strip()]


def test_reads_printed_lines_in_order(ocr):
    r = ocr.post_image("/api/v1/ocr", page(["HELLO ONECARD", "INVOICE 4217"]))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert lines(doc["text"]) == ["HELLOONECARD", "INVOICE4217"], doc
    assert (doc["width"], doc["height"]) == (720, 200)
    assert all(line["score"] >= 0.5 and len(line["box"]) == 4 for line in doc["lines"])


@pytest.mark.parametrize("form", ["multipart", "json"])
def test_every_input_form(ocr, form):
    r = ocr.post_image("/api/v1/ocr", page(["RECEIPT 99"], fmt="JPEG"), form=form, params={"min_score": 0.3})
    assert r.status_code == 200, r.text
    assert lines(r.json()["text"]) == ["RECEIPT99"]


def test_a_blank_page_has_no_text(ocr):
    r = ocr.post_image("/api/v1/ocr", page([]))
    assert r.status_code == 200 and r.json()["lines"] == [] and r.json()["text"] == ""


def test_bad_requests_get_the_envelope(ocr):
    assert_error(ocr.post_image("/api/v1/ocr", page(["X"]), params={"min_score": 2}), 422, "invalid_parameter",
                 "min_score")
    assert_error(ocr.post("/api/v1/ocr", content=b"\x89PNG\r\n\x1a\nbroken", headers={"content-type": "image/png"}),
                 400, "corrupt_image")
    assert_error(ocr.post("/api/v1/ocr", content=b"GIF89a...", headers={"content-type": "image/gif"}), 415,
                 "unsupported_image")
    assert_error(ocr.post("/api/v1/ocr", json={"min_score": 0.5}), 422, "invalid_parameter", "image")
    info = ocr.get("/info").json()
    assert info["model_label"] == "ocr/rapidocr/ppocr-v4" and info["ready"] is True

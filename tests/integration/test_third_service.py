"""A third service, written only with onecard in a folder of its own (examples/ocr), runs in a
unit beside the built-in ones with one config block: the supervisor starts it from its
folder (PYTHONPATH in its env), waits for its warm-up, shows it in status, the jobs API runs
its route, and the unit stops cleanly."""

from __future__ import annotations

import base64
import io
import signal
import time

import httpx
import pytest
from PIL import Image, ImageDraw, ImageFont

from tests.harness import ROOT, free_port
from tests.integration.test_end_to_end import DefaultConfigRun

pytest.importorskip("rapidocr_onnxruntime")


def text_picture(text: str) -> bytes:
    img = Image.new("RGB", (600, 120), "white")
    ImageDraw.Draw(img).text((30, 35), text, fill="black", font=ImageFont.load_default(size=40))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_the_ocr_example_runs_in_the_unit_beside_detect_and_img2img(tmp_path):
    run = DefaultConfigRun(tmp_path)
    port = free_port()
    run.ports["ocr"] = port
    run.extra_args += ["--set", 'services.ocr.app="ocr_service.app:create_app"', "--set", f"services.ocr.port={port}",
                       "--set", "services.ocr.memory_fraction=0.15",
                       "--set", f'services.ocr.env.PYTHONPATH="{ROOT / "examples" / "ocr"}"',
                       "--set", "services.ocr.settings.warmup_runs=1"]
    with run:
        run.wait_ready(timeout=240)
        r = httpx.post(f"http://127.0.0.1:{port}/api/v1/ocr", content=text_picture("UNIT 7"),
                       headers={"content-type": "image/png"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["text"].replace(" ", "").upper() == "UNIT7"
        assert "decode;dur=" in r.headers["server-timing"]
        info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()
        assert info["model_label"] == "ocr/rapidocr/ppocr-v4"
        jobs = f"http://127.0.0.1:{run.ports['jobs']}"
        job = httpx.post(jobs + "/v1/jobs", json={"service": "ocr", "route": "/api/v1/ocr",
                                                  "image": base64.b64encode(text_picture("JOB 42")).decode()},
                         timeout=60)
        assert job.status_code == 202, job.text
        deadline = time.monotonic() + 60
        while (doc := httpx.get(jobs + job.headers["location"], timeout=10).json())["state"] in ("queued", "running"):
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert doc["state"] == "succeeded" and doc["result"]["text"].replace(" ", "").upper() == "JOB42", doc
        time.sleep(2.5)  # a liveness period: the supervisor reads /stats
        ocr = next(s for s in run.status_doc()["services"] if s["name"] == "ocr")
        assert ocr["state"] == "ready" and ocr["served"] >= 2
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        assert not run.wait_no_leftovers()

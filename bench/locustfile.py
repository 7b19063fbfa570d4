"""Load-test your own onecard deployment with Locust:

    pip install locust
    ONECARD_IMAGE=photo.jpg locust -f bench/locustfile.py --host http://127.0.0.1

Ports default to the shipped configs (detect 7862, img2img 7861); override with
ONECARD_DETECT_URL / ONECARD_IMG2IMG_URL. ONECARD_API_KEY is sent when set.
"""

from __future__ import annotations

import os
from pathlib import Path

from locust import HttpUser, between, task

IMAGE = Path(os.environ.get("ONECARD_IMAGE", "photo.jpg")).read_bytes()
CTYPE = "image/png" if IMAGE[:4] == b"\x89PNG" else "image/jpeg"
DETECT = os.environ.get("ONECARD_DETECT_URL", "http://127.0.0.1:7862") + "/api/v1/facedetect"
IMG2IMG = os.environ.get("ONECARD_IMG2IMG_URL", "http://127.0.0.1:7861") + "/api/v1/img2img"
HEADERS = {"content-type": CTYPE}
if os.environ.get("ONECARD_API_KEY"):
    HEADERS["Authorization"] = f"Bearer {os.environ['ONECARD_API_KEY']}"


class DetectUser(HttpUser):
    weight = 4
    wait_time = between(0.0, 0.2)

    @task
    def detect(self):
        with self.client.post(DETECT, data=IMAGE, headers=HEADERS, name="facedetect", catch_response=True) as r:
            if r.status_code != 200 or "faces" not in r.json():
                r.failure(f"{r.status_code}: {r.text[:200]}")


class Img2ImgUser(HttpUser):
    weight = 1
    wait_time = between(0.5, 2.0)

    @task
    def img2img(self):
        with self.client.post(IMG2IMG + "?style=3&format=jpeg", data=IMAGE, headers=HEADERS, name="img2img",
                              catch_response=True) as r:
            if r.status_code != 200 or not r.headers.get("content-type", "").startswith("image/"):
                r.failure(f"{r.status_code}: {r.text[:200]}")

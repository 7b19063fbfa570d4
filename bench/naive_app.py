"""The naive baseline: ONE uvicorn process serves both routes, and every model call goes
through one shared single-thread executor, so a face detection waits behind whatever
img2img job is running. Same backends, same images, same decode as the real services."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

import onecard
from services.detect.backends import CenterFaceBackend, DetectItem
from services.detect.settings import DetectSettings
from services.img2img.params import Img2ImgItem, parse_style
from services.img2img.progress import Progress
from services.img2img.settings import Img2ImgSettings
from services.img2img.style import StyleBackend
from services.runtime.codecs.images import DecodeLimits, decode_image, encode_image
from services.runtime.device.threads import apply_threads, planned_threads

LIMITS = DecodeLimits(max_pixels=40_000_000)


def create_app(settings: dict[str, Any]) -> FastAPI:
    detect = CenterFaceBackend(DetectSettings.model_validate(settings.get("detect", {})))
    img2img = StyleBackend(Img2ImgSettings.model_validate(settings.get("img2img", {})), Progress())
    pool = concurrent.futures.ThreadPoolExecutor(1)  # the one shared executor
    ready = {"ok": False}

    async def lifespan(app):
        apply_threads(planned_threads())
        detect.load(onecard.Setup("detect", detect.settings, planned_threads()))
        img2img.load(onecard.Setup("img2img", img2img.settings, planned_threads()))
        detect.infer_batch(detect.warmup_items())
        img2img.infer_batch(img2img.warmup_items())
        ready["ok"] = True
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/readyz")
    async def readyz():
        # the harness takes only an answer that names the instance it started
        return JSONResponse({"ready": ready["ok"]}, status_code=200 if ready["ok"] else 503,
                            headers={"X-Onecard-Instance": os.environ.get("ONECARD_INSTANCE_TOKEN", "")})

    # the naive design decodes and encodes on the event loop, as many services do
    @app.post("/api/v1/facedetect")
    async def facedetect(request: Request):
        img = decode_image(await request.body(), LIMITS)
        loop = asyncio.get_running_loop()
        faces = await loop.run_in_executor(pool, detect.infer_batch, [DetectItem(img.rgb, 0.5, None)])
        return {"faces": faces[0], "width": img.width, "height": img.height}

    @app.post("/api/v1/img2img")
    async def run_img2img(request: Request):
        img = decode_image(await request.body(), LIMITS)
        item = Img2ImgItem(Image.fromarray(img.rgb), "", "", 1.0, 1, 0.0, 0, (img.width, img.height),
                           style_weights=parse_style(int(request.query_params.get("style", 0))))
        img2img.prepare(item)
        out = await asyncio.get_running_loop().run_in_executor(pool, img2img.infer_batch, [item])
        data, mime = encode_image(np.asarray(Image.fromarray(out[0]).resize(item.out_size)), "png")
        return Response(data, media_type=mime)

    return app

"""The naive baseline: ONE uvicorn process serves both routes, and every model call goes
through one shared single-thread executor, so a face detection waits behind whatever
img2img job is running. Same backends, same images, same decode as the real services."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.detect.backends import CenterFaceBackend, DetectItem
from services.detect.settings import DetectSettings
from services.img2img.backends import StyleBackend
from services.img2img.params import Img2ImgItem, Progress
from services.img2img.settings import Img2ImgSettings
from services.runtime.codec import encode_image, read_image_request
from services.runtime.threads import apply_threads, planned_threads


def create_app(settings: dict[str, Any]) -> FastAPI:
    detect = CenterFaceBackend(DetectSettings.model_validate(settings.get("detect", {})))
    img2img = StyleBackend(Img2ImgSettings.model_validate(settings.get("img2img", {})), Progress())
    pool = concurrent.futures.ThreadPoolExecutor(1)  # the one shared executor
    ready = {"ok": False}

    async def lifespan(app):
        apply_threads(planned_threads())
        detect.load()
        img2img.load()
        detect.infer_batch(detect.warmup_items())
        img2img.infer_batch(img2img.warmup_items())
        ready["ok"] = True
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/readyz")
    async def readyz():
        return JSONResponse({"ready": ready["ok"]}, status_code=200 if ready["ok"] else 503)

    @app.post("/api/v1/facedetect")
    async def facedetect(request: Request):
        img = await read_image_request(request, 20 * 2**20, 40_000_000)
        loop = asyncio.get_running_loop()
        faces = await loop.run_in_executor(pool, detect.infer_batch, [DetectItem(img.image.rgb, 0.5, None)])
        return {"faces": faces[0], "width": img.image.width, "height": img.image.height}

    @app.post("/api/v1/img2img")
    async def run_img2img(request: Request):
        img = await read_image_request(request, 20 * 2**20, 40_000_000)
        item = Img2ImgItem(img.image.rgb, "", "", 1.0, 1, 0.0, 0, style=int(request.query_params.get("style", 0)))
        out = await asyncio.get_running_loop().run_in_executor(pool, img2img.infer_batch, [item])
        data, mime = encode_image(out[0], "png")
        return Response(data, media_type=mime)

    return app

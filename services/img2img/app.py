"""The img2img service: POST /api/v1/img2img, and the webui-compatible /sdapi/v1/img2img
and /sdapi/v1/progress."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.img2img.backends import BACKENDS
from services.img2img.params import (Img2ImgItem, Img2ImgParams, Progress, WebuiImg2ImgRequest, resolve_seed,
                                     validate)
from services.img2img.settings import Img2ImgSettings
from services.runtime.app import ServiceContext, create_service_app
from services.runtime.codec import Timing, decode_base64, decode_image, encode_image, read_json_object
from services.runtime.errors import ApiError

IMAGE_BODY = {"content": {
    "image/png": {"schema": {"type": "string", "format": "binary"}},
    "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
    "application/json": {"schema": {"type": "object", "required": ["image"], "properties": {
        "image": {"type": "string", "description": "base64"}, "style_image": {"type": "string"},
        "prompt": {"type": "string"}, "negative_prompt": {"type": "string"}, "strength": {"type": "number"},
        "steps": {"type": "integer"}, "guidance_scale": {"type": "number"}, "seed": {"type": "integer"},
        "style": {"type": "string"}, "format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
        "response_format": {"type": "string", "enum": ["image", "json"]}}}},
    "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
        "image": {"type": "string", "format": "binary"}, "style_image": {"type": "string", "format": "binary"}}}},
}, "required": True}


def _style_image(params: dict[str, Any], form_file: bytes | None, max_pixels: int) -> np.ndarray | None:
    raw = params.pop("style_image", None)
    if form_file is not None:
        return decode_image(form_file, max_pixels).rgb
    if raw is None:
        return None
    return decode_image(decode_base64(raw, "style_image"), max_pixels).rgb


def add_routes(app: FastAPI, ctx: ServiceContext, cfg: Img2ImgSettings, progress: Progress) -> None:
    def steps_of(asked: int | None) -> int:
        steps = asked or cfg.default_steps
        if steps > cfg.max_steps:
            raise ApiError(422, "invalid_parameter", f"steps: at most {cfg.max_steps} on this service")
        return steps

    def check_prompt(*texts: str) -> None:
        for name, text in zip(("prompt", "negative_prompt"), texts):
            if len(text) > cfg.max_prompt_chars:
                raise ApiError(422, "invalid_parameter", f"{name}: at most {cfg.max_prompt_chars} characters")

    @app.post("/api/v1/img2img", summary="Transform an image", openapi_extra={"requestBody": IMAGE_BODY},
              responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}, "application/json": {}}}})
    async def img2img(request: Request) -> Any:
        timing = Timing()
        img = await ctx.read_image(request, timing)
        extra = dict(img.params)
        style_file = None
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            part = (await request.form()).get("style_image")
            if part is not None and not isinstance(part, str):
                style_file = await part.read()
        style_rgb = _style_image(extra, style_file, cfg.max_pixels)
        merged = {**dict(request.query_params), **extra}
        params = validate(Img2ImgParams, merged)
        check_prompt(params.prompt, params.negative_prompt)
        wants_json = params.response_format == "json" or "application/json" in request.headers.get("accept", "")
        seed = resolve_seed(params.seed)
        item = Img2ImgItem(img.image.rgb, params.prompt, params.negative_prompt, params.strength,
                           steps_of(params.steps), params.guidance_scale, seed, style=params.style,
                           style_rgb=style_rgb, job=uuid.uuid4().hex[:8])
        out = await ctx.infer(request, item, timing)
        t0 = time.perf_counter()
        data, mime = encode_image(out, params.format)
        headers = {"X-Seed": str(seed)}
        if wants_json:
            doc = {"image": base64.b64encode(data).decode(), "seed": seed, "width": out.shape[1],
                   "height": out.shape[0], "format": params.format}
            return ctx.respond(Response(json.dumps(doc), media_type="application/json", headers=headers), timing, t0)
        return ctx.respond(Response(data, media_type=mime, headers=headers), timing, t0)

    @app.post("/sdapi/v1/img2img", summary="AUTOMATIC1111 webui img2img subset",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": WebuiImg2ImgRequest.model_json_schema()}}}})
    async def sdapi_img2img(request: Request) -> Any:
        timing = Timing()
        t0 = time.perf_counter()
        doc = await read_json_object(request, cfg.max_body_bytes)
        req = validate(WebuiImg2ImgRequest, doc)
        check_prompt(req.prompt, req.negative_prompt)
        image = decode_image(decode_base64(req.init_images[0], "init_images.0"), cfg.max_pixels)
        timing.add("decode", time.perf_counter() - t0)
        ctx.check_size(image.width, image.height)
        size = (req.width or image.width, req.height or image.height)
        if size[0] * size[1] > cfg.max_pixels:
            raise ApiError(413, "too_many_pixels", f"width x height is over the limit of {cfg.max_pixels}")
        seed = resolve_seed(req.seed)
        item = Img2ImgItem(image.rgb, req.prompt, req.negative_prompt, req.denoising_strength, steps_of(req.steps),
                           req.cfg_scale, seed, size=size, sampler=req.sampler_name, job=uuid.uuid4().hex[:8])
        out = await ctx.infer(request, item, timing)
        t1 = time.perf_counter()
        png, _ = encode_image(out, "png")
        known = WebuiImg2ImgRequest.model_fields
        parameters = {k: v for k, v in req.model_dump().items() if k in known and k != "init_images"}
        ignored = sorted(k for k in doc if k not in known)
        info = {"seed": seed, "all_seeds": [seed], "prompt": req.prompt, "negative_prompt": req.negative_prompt,
                "width": out.shape[1], "height": out.shape[0], "steps": item.steps, "cfg_scale": req.cfg_scale,
                "denoising_strength": req.denoising_strength, "backend": cfg.backend,
                "sampler_name": req.sampler_name if cfg.backend == "diffusers" else None,
                "ignored_fields": ignored}
        result = {"images": [base64.b64encode(png).decode()], "parameters": parameters, "info": json.dumps(info)}
        return ctx.respond(Response(json.dumps(result), media_type="application/json"), timing, t1)

    @app.get("/sdapi/v1/progress", summary="The running job's progress (webui shape)")
    async def sdapi_progress() -> Any:
        return progress.snapshot()


def create_app(settings: dict[str, Any]) -> FastAPI:
    cfg = Img2ImgSettings.model_validate(settings)
    progress = Progress()
    backend = BACKENDS[cfg.backend](cfg, progress)
    return create_service_app(os.environ.get("ONECARD_SERVICE_NAME", "img2img"), cfg, backend,
                              lambda app, ctx: add_routes(app, ctx, cfg, progress), title="onecard img2img")

"""The AUTOMATIC1111 webui API surface that clients call (webuiapi, sd-backend-client).

img2img and txt2img go through the runtime's pipeline like every model route. A request
brings ``batch_size x n_iter`` items, seeded ``seed, seed+1, ...`` as the webui does, which
the scheduler batches (with each other and with compatible requests). Listings and
options answer what applies here and empty lists where nothing does, never a 404 for a
route clients call routinely. Errors on /sdapi routes take the webui's shape.
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image, ImageFilter, ImageOps
from pydantic import ConfigDict, Field

from services.img2img.params import MAX_SEED, Img2ImgItem
from services.img2img.webui_info import WebuiState, info_document, listing_routes
from services.runtime.body import RawRequest
from services.runtime.codec import decode_base64, decode_image, encode_image
from services.runtime.errors import ApiError
from services.runtime.inputs import decode_limits, read_json
from services.runtime.params import Bool, Float, Int, Params, Str, inline_schema, validate
from services.runtime.pipeline import ModelRoute, Reply, Work, json_reply

SAMPLER_DEFAULT = "Euler a"


class _WebuiBase(Params):
    """Fields both generation routes share; any other webui field is accepted and ignored
    (listed in the answer's info as ignored_fields), as the webui ignores what no script uses."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    prompt: Str | None = Field("", max_length=100_000)
    negative_prompt: Str | None = Field("", max_length=100_000)
    steps: Int | None = Field(20, ge=1, le=1000)
    cfg_scale: Float | None = Field(7.0, ge=0.0, le=50.0)
    seed: Int | None = Field(-1, ge=-1, le=MAX_SEED)
    width: Int | None = Field(512, ge=8, le=8192)
    height: Int | None = Field(512, ge=8, le=8192)
    sampler_name: Str | None = Field(None, max_length=64)
    sampler_index: Str | None = Field(None, max_length=64)
    scheduler: Str | None = Field(None, max_length=64)
    batch_size: Int | None = Field(1, ge=1, le=256)
    n_iter: Int | None = Field(1, ge=1, le=256)
    send_images: Bool | None = True
    save_images: Bool | None = False
    override_settings: dict[str, Any] | None = None
    override_settings_restore_afterwards: Bool | None = True
    styles: list[Str] | None = None
    force_task_id: Str | None = Field(None, max_length=128)


class WebuiImg2Img(_WebuiBase):
    init_images: list[Str] = Field(..., min_length=1, max_length=64)
    denoising_strength: Float | None = Field(0.75, ge=0.0, le=1.0)
    resize_mode: Int | None = Field(0, ge=0, le=3)
    mask: Str | None = None
    mask_blur: Int | None = Field(4, ge=0, le=256)
    mask_blur_x: Int | None = Field(None, ge=0, le=256)
    mask_blur_y: Int | None = Field(None, ge=0, le=256)
    inpainting_fill: Int | None = Field(1, ge=0, le=3)
    inpaint_full_res: Bool | Int | None = True
    inpaint_full_res_padding: Int | None = Field(32, ge=0, le=1024)
    inpainting_mask_invert: Int | Bool | None = Field(0, ge=0, le=1)
    include_init_images: Bool | None = False


class WebuiTxt2Img(_WebuiBase):
    enable_hr: Bool | None = False


def _sdapi_error(exc: ApiError) -> dict[str, Any]:
    """The webui's error body, with our code kept in `error`."""
    return {"error": exc.code, "detail": exc.message, "body": "", "errors": exc.message}


def resize_to(img: Image.Image, size: tuple[int, int], mode: int, fill: bool = True) -> Image.Image:
    """The webui's resize modes: 0 stretch, 1 crop and resize, 2 resize and fill, 3 (latent) stretch."""
    if img.size == size:
        return img
    if mode == 1:
        return ImageOps.fit(img, size, Image.LANCZOS)
    if mode == 2:
        inner = ImageOps.contain(img, size, Image.LANCZOS)
        canvas = inner.resize(size, Image.LANCZOS).filter(ImageFilter.GaussianBlur(16)) if fill else \
            Image.new(img.mode, size)
        canvas.paste(inner, ((size[0] - inner.width) // 2, (size[1] - inner.height) // 2))
        return canvas
    return img.resize(size, Image.LANCZOS)


def _mask_of(req: WebuiImg2Img, size: tuple[int, int], limits) -> Image.Image | None:
    if not req.mask:
        return None
    raw = decode_image(decode_base64(req.mask, "mask"), limits)
    mask = Image.fromarray(raw.rgb).convert("L")
    mask = resize_to(mask, size, req.resize_mode or 0, fill=False)
    if req.inpainting_mask_invert:
        mask = ImageOps.invert(mask)
    bx = req.mask_blur_x if req.mask_blur_x is not None else req.mask_blur or 0
    by = req.mask_blur_y if req.mask_blur_y is not None else req.mask_blur or 0
    if bx or by:
        mask = mask.filter(ImageFilter.GaussianBlur((bx / 2, by / 2)))
    return mask


class WebuiRoutes:
    def __init__(self, routes, ctx, state: WebuiState):
        self.r, self.ctx, self.state = routes, ctx, state  # routes: app.Img2ImgRoutes

    # ---- shared -----------------------------------------------------------------------
    def _plan(self, req: _WebuiBase, kind: str) -> tuple[int, list[int], str]:
        n = (req.batch_size or 1) * (req.n_iter or 1)
        if n > self.r.cfg.max_images:
            raise ApiError(422, "invalid_parameter",
                           f"batch_size x n_iter: {n} images is over this service's max_images of {self.r.cfg.max_images}")
        self.r.check_prompts(req.prompt or "", req.negative_prompt or "")
        seed = req.seed if req.seed is not None and req.seed >= 0 else int.from_bytes(uuid.uuid4().bytes[:4], "big")
        seeds = [(seed + i) % (MAX_SEED + 1) for i in range(n)]
        sampler = req.sampler_name or req.sampler_index or self.state.options.get("sampler_name") or SAMPLER_DEFAULT
        return n, seeds, sampler

    def _ignored(self, req: _WebuiBase) -> list[str]:
        return sorted((req.model_extra or {}).keys())

    # ---- img2img ----------------------------------------------------------------------
    def decode_img2img(self, raw: RawRequest) -> Work:
        doc = read_json(raw, self.r.cfg)
        req = validate(WebuiImg2Img, doc)
        n, seeds, sampler = self._plan(req, "img2img")
        limits = decode_limits(self.r.cfg)
        inits = []
        for i, text in enumerate(req.init_images):
            img = decode_image(decode_base64(text, f"init_images.{i}", self.r.cfg.max_body_bytes), limits,
                               self.r.cfg.max_side)
            self.r.check_size(img.width, img.height, f"init_images.{i}")
            inits.append(Image.fromarray(img.rgb))
        width = req.width or inits[0].width
        height = req.height or inits[0].height
        if width * height > self.r.cfg.max_pixels:
            raise ApiError(413, "too_many_pixels", f"width x height is over the limit of {self.r.cfg.max_pixels}")
        mask = _mask_of(req, (width, height), limits)
        strength = req.denoising_strength if req.denoising_strength is not None else 0.75
        steps = self.r.steps(req.steps)
        job = req.force_task_id or uuid.uuid4().hex[:12]
        items = []
        for i in range(n):
            base = resize_to(inits[i % len(inits)].convert("RGB"), (width, height), req.resize_mode or 0)
            item = Img2ImgItem(base, req.prompt or "", req.negative_prompt or "", strength, steps,
                               req.cfg_scale if req.cfg_scale is not None else 7.0, seeds[i], (width, height),
                               style_weights=self.state.style_weights(req), sampler=sampler, size=None,
                               mask=mask, job=job)
            items.append(self.r.prepare(item))
        return Work(items, items[0].key, {"req": req, "kind": "img2img", "sampler": sampler, "seeds": seeds,
                                          "width": width, "height": height, "steps": steps,
                                          "strength": strength, "inits": req.init_images})

    # ---- txt2img ----------------------------------------------------------------------
    def decode_txt2img(self, raw: RawRequest) -> Work:
        if not getattr(self.r.backend, "supports_text_to_image", False):
            raise ApiError(422, "unsupported", f"txt2img needs the diffusers backend; this service runs "
                                               f"{self.r.backend.name!r}, which only transforms a picture")
        doc = read_json(raw, self.r.cfg)
        req = validate(WebuiTxt2Img, doc)
        n, seeds, sampler = self._plan(req, "txt2img")
        width, height = req.width or 512, req.height or 512
        if width * height > self.r.cfg.max_pixels:
            raise ApiError(413, "too_many_pixels", f"width x height is over the limit of {self.r.cfg.max_pixels}")
        side = self.r.cfg.max_side
        gen = (width, height) if max(width, height) <= side else (
            max(8, round(width * side / max(width, height))), max(8, round(height * side / max(width, height))))
        steps = self.r.steps(req.steps)
        job = req.force_task_id or uuid.uuid4().hex[:12]
        items = []
        for i in range(n):
            item = Img2ImgItem(None, req.prompt or "", req.negative_prompt or "", 1.0, steps,
                               req.cfg_scale if req.cfg_scale is not None else 7.0, seeds[i], (width, height),
                               sampler=sampler, size=gen, job=job)
            items.append(self.r.prepare(item))
        return Work(items, items[0].key, {"req": req, "kind": "txt2img", "sampler": sampler, "seeds": seeds,
                                          "width": width, "height": height, "steps": steps, "strength": None,
                                          "inits": []})

    # ---- the answer -------------------------------------------------------------------
    def encode(self, work: Work, results: list[Any], raw: RawRequest) -> Reply:
        st = work.state
        req = st["req"]
        images = []
        if req.send_images is not False:
            for item, out in zip(work.items, results):
                png, _ = encode_image(self.r.finish(item, out), "png")
                images.append(base64.b64encode(png).decode())
            if st["kind"] == "img2img" and req.include_init_images:
                images += list(st["inits"])
        info = info_document(st, req, self.state, self.r, len(work.items))
        info["ignored_fields"] = self._ignored(req)
        parameters = req.model_dump(exclude={"init_images", "mask"}) if st["kind"] == "img2img" else req.model_dump()
        if st["kind"] == "img2img":
            parameters["init_images"] = None
            parameters["mask"] = None
        return json_reply({"images": images, "parameters": parameters, "info": json.dumps(info)})

    def route(self, kind: str) -> ModelRoute:
        decode = self.decode_img2img if kind == "img2img" else self.decode_txt2img
        model = WebuiImg2Img if kind == "img2img" else WebuiTxt2Img
        return ModelRoute(
            f"/sdapi/v1/{kind}", decode, self.encode, summary=f"AUTOMATIC1111 webui {kind}", tags=["webui"],
            request_body={"required": True, "content": {"application/json": {"schema": inline_schema(model)}}},
            responses={200: {"description": "images (base64 PNG), the parameters, and info (a JSON string)",
                             "content": {"application/json": {"schema": {
                                 "type": "object", "required": ["images", "parameters", "info"], "properties": {
                                     "images": {"type": "array", "items": {"type": "string"}},
                                     "parameters": {"type": "object"}, "info": {"type": "string"}}}}}}},
            error_body=_sdapi_error)


def add_routes(app: FastAPI, ctx, routes) -> None:
    state = WebuiState(routes)
    web = WebuiRoutes(routes, ctx, state)
    ctx.pipeline.add(app, web.route("img2img"))
    ctx.pipeline.add(app, web.route("txt2img"))
    progress = routes.progress

    @app.get("/sdapi/v1/progress", tags=["webui"], summary="The running generation (webui shape)")
    async def sdapi_progress(skip_current_image: bool = False) -> JSONResponse:
        doc, preview = progress.snapshot()
        if preview is not None and not skip_current_image:
            doc["current_image"] = await ctx.cpu.run(_preview_png, preview)
        return JSONResponse(doc)

    @app.post("/sdapi/v1/interrupt", tags=["webui"], summary="Stop the running generation between steps")
    async def sdapi_interrupt() -> JSONResponse:
        progress.interrupt()
        return JSONResponse(None)

    @app.post("/sdapi/v1/skip", tags=["webui"], summary="Skip the running generation")
    async def sdapi_skip() -> JSONResponse:
        progress.skip()
        return JSONResponse(None)

    @app.get("/sdapi/v1/options", tags=["webui"], summary="Settings (webui shape)")
    async def get_options() -> JSONResponse:
        return JSONResponse(state.options)

    @app.post("/sdapi/v1/options", tags=["webui"], summary="Change settings (kept for this process)")
    async def set_options(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > 1_000_000:
            raise ApiError(413, "body_too_large", "options body over 1 MB")
        doc = await ctx.cpu.run(read_json, RawRequest("POST", "/sdapi/v1/options", {}, {}, "application/json",
                                                      "application/json", body), routes.cfg)
        state.update_options(doc)
        return JSONResponse(None)

    listing_routes(app, state, ctx)


def _preview_png(preview) -> str:
    img = preview() if callable(preview) else preview
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


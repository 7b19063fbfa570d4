"""The AUTOMATIC1111 webui API surface that clients call (webuiapi, sd-backend-client).

img2img and txt2img go through the runtime's pipeline like every model route. A request
brings ``batch_size x n_iter`` items seeded ``seed, seed+1, ...`` as the webui seeds them,
which the scheduler batches (with each other and with compatible requests). Masks are
prepared as the webui prepares them (webui_images), and outside the mask the answer is
the original picture, pixel for pixel. Defaults are the webui API's. Listings answer what
applies here and empty lists where nothing does; errors on /sdapi routes, unknown ones
included, take the webui's shape ``{"error", "detail", "body", "errors"}``.
"""

from __future__ import annotations

import base64
import io
import json
import random
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import ConfigDict, Field

from services.img2img import webui_images as wi
from services.img2img.params import MAX_SEED, Img2ImgItem
from services.img2img.webui_info import (OUTPUT_FORMATS, WebuiState, guard, info_document, infotext, listing_routes,
                                         not_found_routes, sdapi_error)
from services.runtime.body import RawRequest, parse_json_object, read_body
from services.runtime.codec import decode_base64, decode_image
from services.runtime.errors import ApiError
from services.runtime.inputs import decode_limits, read_json
from services.runtime.params import Bool, Float, Int, Params, Str, inline_schema, validate
from services.runtime.pipeline import ModelRoute, Reply, Work, json_reply

MAX_OPTIONS_BYTES = 1_000_000


class _WebuiBase(Params):
    """Fields both generation routes share, with the webui API's defaults. Any other webui
    field is accepted and ignored (named in the answer's info as ignored_fields)."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    prompt: Str | None = Field("", max_length=100_000)
    negative_prompt: Str | None = Field("", max_length=100_000)
    steps: Int | None = Field(None, ge=1, le=1000, description="absent: the service's default_steps")
    cfg_scale: Float | None = Field(7.0, ge=0.0, le=50.0)
    seed: Int | None = Field(-1, ge=-1, le=MAX_SEED, description="-1: random; image i gets seed + i")
    subseed: Int | None = Field(-1, ge=-1, le=MAX_SEED)
    subseed_strength: Float | None = Field(0.0, ge=0.0, le=1.0)
    seed_resize_from_w: Int | None = Field(-1, ge=-1, le=8192)
    seed_resize_from_h: Int | None = Field(-1, ge=-1, le=8192)
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
    # the webui's slider stops at 64; a wider Gaussian costs decode time for nothing
    mask_blur: Int | None = Field(None, ge=0, le=64, description="sets mask_blur_x and mask_blur_y")
    mask_blur_x: Int | None = Field(4, ge=0, le=64)
    mask_blur_y: Int | None = Field(4, ge=0, le=64)
    inpainting_fill: Int | None = Field(0, ge=0, le=3, description="0 fill, 1 original, 2 latent noise, 3 nothing")
    inpaint_full_res: Bool | Int | None = Field(True, description="inpaint only the masked region, at full size")
    inpaint_full_res_padding: Int | None = Field(0, ge=0, le=1024)
    inpainting_mask_invert: Int | Bool | None = Field(0, ge=0, le=1)
    include_init_images: Bool | None = False


class WebuiTxt2Img(_WebuiBase):
    enable_hr: Bool | None = False
    denoising_strength: Float | None = Field(None, ge=0.0, le=1.0)


def _random_seed() -> int:
    return random.randrange(MAX_SEED)


class WebuiRoutes:
    def __init__(self, routes, ctx, state: WebuiState):
        self.r, self.ctx, self.state = routes, ctx, state  # routes: app.Img2ImgRoutes

    # ---- shared -----------------------------------------------------------------------
    def _options(self, req: _WebuiBase) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """(the options this request runs with, the overrides to keep afterwards, what is ignored)."""
        over = dict(req.override_settings or {})
        ignored = []
        if "sd_model_checkpoint" in over and not self.state.is_this_model(over["sd_model_checkpoint"]):
            over.pop("sd_model_checkpoint")  # as the webui does with a checkpoint it cannot find
            ignored.append("override_settings.sd_model_checkpoint")
        over = self.state.checked(over, "override_settings.")
        opts = {**self.state.options, **over}
        if opts.get("CLIP_stop_at_last_layers", 1) != 1:
            ignored.append("CLIP_stop_at_last_layers")
        keep = over if req.override_settings_restore_afterwards is False else {}
        return opts, keep, ignored

    def _plan(self, req: _WebuiBase, batch_size: int, kind: str,
              fallback: tuple[int, int] = (512, 512)) -> dict[str, Any]:
        n = batch_size * (req.n_iter or 1)
        if n > self.r.cfg.max_images:
            raise ApiError(422, "invalid_parameter", f"batch_size x n_iter: {n} images is over this service's "
                                                     f"max_images of {self.r.cfg.max_images}")
        extra = req.model_extra or {}
        scripts = [extra["script_name"]] if extra.get("script_name") else []
        if isinstance(extra.get("alwayson_scripts"), dict):
            scripts += list(extra["alwayson_scripts"])
        if scripts:  # as the webui answers for a script it does not have
            raise ApiError(422, "script_not_found", f"Script {str(scripts[0])[:64]!r} not found: this service "
                                                    f"runs no scripts (see /sdapi/v1/scripts)")
        prompt, negative = req.prompt or "", req.negative_prompt or ""
        self.r.check_prompts(prompt, negative)
        seed = req.seed if req.seed is not None and req.seed >= 0 else _random_seed()
        subseed = req.subseed if req.subseed is not None and req.subseed >= 0 else _random_seed()
        sampler, key, schedule = self.state.sampler(req.sampler_name or req.sampler_index, req.scheduler)
        opts, keep, ignored = self._options(req)
        width, height = req.width or fallback[0], req.height or fallback[1]
        if width * height > self.r.cfg.max_pixels:
            raise ApiError(413, "too_many_pixels", f"width x height is over the limit of {self.r.cfg.max_pixels}")
        return {"req": req, "kind": kind, "n": n, "batch_size": batch_size, "prompt": prompt,
                "negative_prompt": negative, "seeds": [seed + i for i in range(n)],
                "subseeds": [subseed + i for i in range(n)], "sampler": sampler, "scheduler_key": key,
                "schedule": schedule, "cfg_scale": req.cfg_scale if req.cfg_scale is not None else 7.0,
                "width": width, "height": height, "options": opts, "keep_options": keep,
                "ignored": sorted([*(req.model_extra or {}).keys(), *ignored]), "extra": {},
                "job": uuid.uuid4().hex, "job_timestamp": time.strftime("%Y%m%d%H%M%S")}

    def _finish_plan(self, gen: dict[str, Any], items: list[Img2ImgItem]) -> Work:
        if gen["keep_options"]:  # override_settings_restore_afterwards = false: they stay
            self.state.update_options(gen["keep_options"])
        self.r.progress.expect(gen["job"], gen["kind"], len(items), gen["batch_size"])
        return Work(items, items[0].key, gen)

    # ---- img2img ----------------------------------------------------------------------
    def decode_img2img(self, raw: RawRequest) -> Work:
        req = validate(WebuiImg2Img, read_json(raw, self.r.cfg))
        limits = decode_limits(self.r.cfg)
        # the answer keeps the original's pixels outside a mask: decode at no less than its size
        reduce_to = None if req.mask and req.inpaint_full_res else 2 * max(req.width or 0, req.height or 0) or None
        inits = []
        for i, text in enumerate(req.init_images):
            img = decode_image(decode_base64(text, f"init_images.{i}", self.r.cfg.max_body_bytes), limits, reduce_to)
            self.r.check_size(img.width, img.height, f"init_images.{i}")
            inits.append(Image.fromarray(img.rgb))
        batch_size = req.batch_size or 1
        if len(inits) > 1:  # the webui runs one image per init image in each batch
            if len(inits) > batch_size:
                raise ApiError(422, "invalid_parameter",
                               f"init_images: {len(inits)} images for a batch_size of {batch_size}; send at most "
                               f"batch_size images")
            batch_size = len(inits)
        gen = self._plan(req, batch_size, "img2img", inits[0].size)
        strength = req.denoising_strength if req.denoising_strength is not None else 0.75
        gen["strength"] = strength
        gen["steps"] = self.r.steps(req.steps)
        run_steps = gen["steps"]
        if gen["options"].get("img2img_fix_steps") and 0.0 < strength < 1.0:
            run_steps = self.r.steps(int(run_steps / min(strength, 0.999)))
        gen["extra"]["Denoising strength"] = strength
        prepared = self._prepare_inits(req, inits, gen, limits)
        gen["overlays"] = []
        opts = gen["options"]
        weights = None if self.state.diffusers else self.state.style_weights(req, opts)
        items = []
        for i in range(gen["n"]):
            image, mask, overlay = prepared[i % batch_size if len(inits) > 1 else 0]
            item = Img2ImgItem(image, gen["prompt"], gen["negative_prompt"], strength, run_steps, gen["cfg_scale"],
                               gen["seeds"][i], (gen["width"], gen["height"]), style_weights=weights,
                               sampler=gen["scheduler_key"], size=None, mask=mask, job=gen["job"])
            items.append(self.r.prepare(item))
            gen["overlays"].append(overlay)
        return self._finish_plan(gen, items)

    def _prepare_inits(self, req: WebuiImg2Img, inits: list[Image.Image], gen: dict[str, Any], limits):
        """Per init image: (what the model starts from, its mask or None, the overlay or None)."""
        size, mode = (gen["width"], gen["height"]), req.resize_mode or 0
        if not req.mask:
            return [(wi.resize_image(img, size, mode), None, None) for img in inits]
        blur_x = req.mask_blur if req.mask_blur is not None else (req.mask_blur_x or 0)
        blur_y = req.mask_blur if req.mask_blur is not None else (req.mask_blur_y or 0)
        data = decode_base64(req.mask, "mask", self.r.cfg.max_body_bytes)
        source = wi.mask_channel(data, decode_image(data, limits).rgb)
        mask = wi.prepare_mask(source, bool(req.inpainting_mask_invert), blur_x, blur_y)
        fill = req.inpainting_fill if req.inpainting_fill is not None else wi.FILL
        extra = gen["extra"]
        extra["Mask blur"] = max(blur_x, blur_y)
        if req.inpainting_mask_invert:
            extra["Mask mode"] = "Inpaint not masked"
        if fill != wi.ORIGINAL and self.state.diffusers:
            extra["Masked content"] = ("fill", "original", "latent noise", "latent nothing")[fill]
        out = []
        for img in inits:
            if req.inpaint_full_res:
                m = mask if mask.size == img.size else mask.resize(img.size, Image.LANCZOS)
                box = wi.crop_region(m, req.inpaint_full_res_padding or 0, size)
                if box is None:  # nothing masked: plain img2img, as the webui falls back
                    out.append((wi.resize_image(img, size, mode), None, None))
                    continue
                extra["Inpaint area"] = "Only masked"
                extra["Masked area padding"] = req.inpaint_full_res_padding or 0
                image = wi.resize_image(img.crop(box), size, 2)
                gen_mask = wi.resize_image(m.crop(box), size, 2)
                overlay = wi.Overlay(img, m, box)
            else:
                image = wi.resize_image(img, size, mode)
                gen_mask = wi.resize_image(mask, size, mode)
                overlay = wi.Overlay(image, wi.doubled(gen_mask))
            if self.state.diffusers:  # the style network sees the picture; filling is for diffusion
                image = wi.fill_masked(image, gen_mask, fill, gen["seeds"][0])
            out.append((image, gen_mask, overlay))
        if any(m is None for _, m, _ in out) and any(m is not None for _, m, _ in out):
            # one request is one batch: an init image with nothing masked inpaints nothing
            blank = Image.new("L", size, 0)
            out = [(img, m, ov) if m is not None else (img, blank, wi.Overlay(img, blank)) for img, m, ov in out]
        return out

    # ---- txt2img ----------------------------------------------------------------------
    def decode_txt2img(self, raw: RawRequest) -> Work:
        if not getattr(self.r.backend, "supports_text_to_image", False):
            raise ApiError(422, "unsupported", f"txt2img needs the diffusers backend; this service runs "
                                               f"{self.r.backend.name!r}, which only transforms a picture")
        req = validate(WebuiTxt2Img, read_json(raw, self.r.cfg))
        gen = self._plan(req, req.batch_size or 1, "txt2img")
        if req.enable_hr:
            gen["ignored"] = sorted([*gen["ignored"], "enable_hr"])  # no second, upscaled pass here
        gen["strength"] = req.denoising_strength
        gen["steps"] = self.r.steps(req.steps)
        width, height, side = gen["width"], gen["height"], self.r.cfg.max_side
        scale = min(1.0, side / max(width, height))
        size = (max(8, round(width * scale)), max(8, round(height * scale)))
        gen["overlays"] = [None] * gen["n"]
        items = [self.r.prepare(Img2ImgItem(None, gen["prompt"], gen["negative_prompt"], 1.0, gen["steps"],
                                            gen["cfg_scale"], gen["seeds"][i], (width, height),
                                            sampler=gen["scheduler_key"], size=size, job=gen["job"]))
                 for i in range(gen["n"])]
        return self._finish_plan(gen, items)

    # ---- the answer -------------------------------------------------------------------
    def encode(self, work: Work, results: list[Any], raw: RawRequest) -> Reply:
        gen = work.state
        req = gen["req"]
        opts = gen["options"]
        fmt = OUTPUT_FORMATS[str(opts.get("samples_format", "png")).lower()]
        produced = [i for i, out in enumerate(results) if out is not None]  # None: interrupted before it ran
        gen["produced"] = produced or [0]
        images = []
        if req.send_images is not False:
            for i in produced:
                img = Image.fromarray(self.r.finish(work.items[i], results[i]))
                if gen["overlays"][i] is not None:
                    img = gen["overlays"][i].apply(img)
                text = infotext(gen, self.state, i) if opts.get("enable_pnginfo", True) else None
                images.append(_encode(img, fmt, opts.get("jpeg_quality", 80), text))
        info = info_document(gen, self.state)
        info["ignored_fields"] = gen["ignored"]
        parameters = req.model_dump()
        if gen["kind"] == "img2img" and not req.include_init_images:
            parameters["init_images"] = None
            parameters["mask"] = None
        return json_reply({"images": images, "parameters": parameters, "info": json.dumps(info)})

    def route(self, kind: str) -> ModelRoute:
        decode = self.decode_img2img if kind == "img2img" else self.decode_txt2img
        model = WebuiImg2Img if kind == "img2img" else WebuiTxt2Img
        return ModelRoute(
            f"/sdapi/v1/{kind}", decode, self.encode, summary=f"AUTOMATIC1111 webui {kind}", tags=["webui"],
            request_body={"required": True, "content": {"application/json": {"schema": inline_schema(model)}}},
            responses={200: {"description": "images (base64), the parameters, and info (a JSON string)",
                             "content": {"application/json": {"schema": {
                                 "type": "object", "required": ["images", "parameters", "info"], "properties": {
                                     "images": {"type": "array", "items": {"type": "string"}},
                                     "parameters": {"type": "object"}, "info": {"type": "string"}}}}}}},
            error_body=sdapi_error)


def _encode(img: Image.Image, fmt: str, quality: int, text: str | None) -> str:
    """Base64 of the picture as the webui sends it: PNG carries the infotext as `parameters`."""
    buf = io.BytesIO()
    if fmt == "png":
        from PIL.PngImagePlugin import PngInfo
        info = None
        if text:
            info = PngInfo()
            info.add_text("parameters", text)
        img.save(buf, "PNG", compress_level=1, pnginfo=info)
    else:
        img.save(buf, "JPEG" if fmt == "jpeg" else "WEBP", quality=quality)
    return base64.b64encode(buf.getvalue()).decode()


def _preview_png(preview: Callable) -> str:
    buf = io.BytesIO()
    preview().save(buf, "PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


def add_routes(app: FastAPI, ctx, routes) -> None:
    state = WebuiState(routes)
    web = WebuiRoutes(routes, ctx, state)
    ctx.pipeline.add(app, web.route("img2img"))
    ctx.pipeline.add(app, web.route("txt2img"))
    progress = routes.progress

    async def get_progress(request: Request) -> JSONResponse:
        doc, preview = progress.snapshot()
        skip = request.query_params.get("skip_current_image", "false").strip().lower() in ("true", "1", "yes")
        if preview is not None and not skip:
            doc["current_image"] = await ctx.cpu.run(_preview_png, preview)
        return JSONResponse(doc)

    async def interrupt() -> JSONResponse:
        progress.interrupt()
        return JSONResponse({})

    async def skip() -> JSONResponse:
        progress.skip()
        return JSONResponse(None)

    async def get_options() -> JSONResponse:
        return JSONResponse(state.options)

    async def set_options(request: Request) -> JSONResponse:
        body = await read_body(request, MAX_OPTIONS_BYTES)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise ApiError(415, "unsupported_media_type", "send the options as application/json")
        doc = await ctx.cpu.run(parse_json_object, body, routes.cfg.max_json_depth, routes.cfg.max_fields)
        state.update_options(doc)
        return JSONResponse(None)

    async def unsupported() -> JSONResponse:
        raise ApiError(422, "unsupported", "this webui endpoint is not available on this service")

    for path, method, fn, summary in (
            ("progress", "GET", get_progress, "The running generation (webui shape); current_image unless "
                                              "skip_current_image=true"),
            ("interrupt", "POST", interrupt, "Stop the running generation between steps; its requests answer "
                                             "with what they have"),
            ("skip", "POST", skip, "End the running batch between steps; the request goes on with its next batch"),
            ("options", "GET", get_options, "Settings (webui shape)"),
            ("options", "POST", set_options, "Change settings (kept for this process)"),
            ("extra-single-image", "POST", unsupported, "Not available here"),
            ("extra-batch-images", "POST", unsupported, "Not available here")):
        app.add_api_route(f"/sdapi/v1/{path}", guard(fn), methods=[method], tags=["webui"], summary=summary)
    listing_routes(app, state, ctx, bool(routes.cfg.basic_auth_env or routes.cfg.basic_auth_file))
    not_found_routes(app)


"""The img2img service: POST /api/v1/img2img, and the AUTOMATIC1111 webui API (webui.py).

Both go through the runtime's pipeline. decode: the image(s), the parameters, and the
backend's prepare (resize to the model's size, batching key), all in the CPU pool.
encode: the backend's post-processing, the mask, the final size and the output format,
in the CPU pool too.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI
from PIL import Image
from pydantic import Field

from services.img2img.params import Img2ImgItem, Img2ImgParams, parse_style, resolve_seed
from services.img2img.progress import Progress
from services.img2img.settings import Img2ImgSettings
from services.runtime.codecs.base64_text import encode_base64
from services.runtime.codecs.encoder_limits import check_encodable
from services.runtime.codecs.images import choose_format, decode_image, encode_image
from services.runtime.codecs.params import Params, inline_schema, query_parameters
from services.runtime.errors import ApiError
from services.runtime.pipeline.image_input import ProbedInput, decode_limits, read_image_input
from services.runtime.pipeline.model_routes import ModelRoute, Reply, Work, json_reply
from services.runtime.pipeline.raw_request import RawRequest
from services.runtime.shell.model_part import model_service_app

BINARY = {"schema": {"type": "string", "format": "binary"}}


def make_backend(cfg: Img2ImgSettings, progress: Progress):
    if cfg.backend == "diffusers":
        from services.img2img.sd import DiffusersBackend
        return DiffusersBackend(cfg, progress)
    from services.img2img.style import StyleBackend
    return StyleBackend(cfg, progress)


class Img2ImgJsonBody(Img2ImgParams):
    image: str = Field(..., description="the input picture, base64")
    style_image: str | None = Field(None, description="style backend: any picture as the style, base64")


class Img2ImgJsonResult(Params):
    image: str = Field(..., description="base64")
    seed: int
    width: int
    height: int
    format: str


class Img2ImgRoutes:
    """The hooks shared by the native and the webui routes."""

    def __init__(self, cfg: Img2ImgSettings, backend, progress: Progress):
        self.cfg, self.backend, self.progress = cfg, backend, progress

    def steps(self, asked: int | None) -> int:
        steps = asked or self.cfg.default_steps
        if steps > self.cfg.max_steps:
            raise ApiError(422, "invalid_parameter", f"steps: at most {self.cfg.max_steps} on this service")
        return steps

    def check_prompts(self, *texts: str) -> None:
        for name, text in zip(("prompt", "negative_prompt"), texts, strict=False):
            if len(text) > self.cfg.max_prompt_chars:
                raise ApiError(422, "invalid_parameter", f"{name}: at most {self.cfg.max_prompt_chars} characters")

    def check_size(self, width: int, height: int, what: str = "image") -> None:
        side = self.backend.min_image_side
        if min(width, height) < side:
            raise ApiError(422, "image_too_small", f"{what}: {width}x{height}: both sides need at least {side} px")

    def prepare(self, item: Img2ImgItem) -> Img2ImgItem:
        self.backend.prepare(item)
        return item

    def finish(self, item: Img2ImgItem, out: np.ndarray) -> np.ndarray:
        """Backend post-processing and the final size. (A webui mask's overlay, which keeps the
        original outside the mask pixel for pixel, is applied by the webui route: webui_images.)"""
        out = self.backend.postprocess(item, out)
        img = Image.fromarray(out)
        if img.size != item.out_size:
            img = img.resize(item.out_size, Image.LANCZOS)
        return np.asarray(img)

    # ---- POST /api/v1/img2img ---------------------------------------------------------
    def model_pixels(self, width: int, height: int) -> int:
        """Pixels the model sees for a picture of this size (fitted to max_side)."""
        scale = min(1.0, self.cfg.max_side / max(width, height))
        return max(1, round(width * scale)) * max(1, round(height * scale))

    def native_cost(self, raw: RawRequest, probed: ProbedInput) -> None:
        p, h = probed.params, probed.header
        self.check_prompts(p.prompt, p.negative_prompt)
        self.check_size(h.width, h.height)
        for name, extra in probed.extra_headers.items():
            self.check_size(extra.width, extra.height, name)
        fmt = choose_format(p.format, raw.headers.get("accept", ""), self.cfg.default_format)
        check_encodable(h.width, h.height, fmt, f"the answer (the picture's own size) in {fmt!r}")
        raw.cost.check(items=1, item_pixels=self.model_pixels(h.width, h.height), input_pixels=probed.input_pixels,
                       output_pixels=h.pixels, base64_output=p.response_format == "json"
                       or raw.headers.get("accept", "").startswith("application/json"))

    def decode_native(self, raw: RawRequest) -> Work:
        got = read_image_input(raw, self.cfg, max_side=self.cfg.max_side, extra_image_fields=("style_image",),
                               params=Img2ImgParams, cost=self.native_cost)
        p = got.params
        img = got.image
        style_rgb = None
        if "style_image" in got.extra_images:
            style = decode_image(got.extra_images["style_image"], decode_limits(self.cfg), 512)
            self.check_size(style.width, style.height, "style_image")
            style_rgb = style.rgb
        fmt = choose_format(p.format, raw.headers.get("accept", ""), self.cfg.default_format)
        item = Img2ImgItem(Image.fromarray(img.rgb), p.prompt, p.negative_prompt, p.strength, self.steps(p.steps),
                           p.guidance_scale, resolve_seed(p.seed), (img.width, img.height),
                           style_weights=parse_style(p.style), style_rgb=style_rgb, job=uuid.uuid4().hex[:12])
        self.prepare(item)
        wants_json = p.response_format == "json" or raw.headers.get("accept", "").startswith("application/json")
        return Work([item], item.key, {"format": fmt, "quality": p.quality, "json": wants_json})

    def encode_native(self, work: Work, results: list[Any], raw: RawRequest) -> Reply:
        item, opts = work.items[0], work.state
        out = self.finish(item, results[0])
        data, mime = encode_image(out, opts["format"], opts["quality"])
        headers = {"X-Seed": str(item.seed)}
        if opts["json"]:
            return json_reply({"image": encode_base64(data), "seed": item.seed, "width": out.shape[1],
                               "height": out.shape[0], "format": opts["format"]}, headers)
        return Reply(data, mime, headers)

    def native_route(self) -> ModelRoute:
        return ModelRoute(
            "/api/v1/img2img", self.decode_native, self.encode_native, summary="Transform an image",
            tags=["img2img"],
            description="The picture as a raw body (`image/*`), a multipart field `image` (and optionally "
                        "`style_image`), or base64 in JSON. Parameters in the query string, the form or the JSON "
                        "object. The answer is the picture (format from `format`, else `Accept`, else the "
                        "service's default), or JSON with `response_format=json` or `Accept: application/json`.",
            parameters=query_parameters(Img2ImgParams),
            request_body={"required": True, "content": {
                "image/jpeg": BINARY, "image/png": BINARY, "image/webp": BINARY, "image/bmp": BINARY,
                "application/json": {"schema": inline_schema(Img2ImgJsonBody)},
                "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
                    "image": {"type": "string", "format": "binary"},
                    "style_image": {"type": "string", "format": "binary"}}}}}},
            responses={200: {"description": "the transformed picture (seed in X-Seed)",
                             "headers": {"X-Seed": {"schema": {"type": "integer"}}},
                             "content": {"image/png": BINARY, "image/jpeg": BINARY, "image/webp": BINARY,
                                         "application/json": {"schema": inline_schema(Img2ImgJsonResult)}}}})


def create_app(settings: dict[str, Any]) -> FastAPI:
    from services.img2img import webui
    cfg = Img2ImgSettings.model_validate(settings)
    progress = Progress()
    backend = make_backend(cfg, progress)
    routes = Img2ImgRoutes(cfg, backend, progress)

    def add_routes(app: FastAPI, part, shell) -> None:
        part.pipeline.add(app, routes.native_route())
        webui.add_routes(app, part, shell, routes)

    # webui clients ping without credentials, as the webui lets them
    return model_service_app(os.environ.get("ONECARD_SERVICE_NAME", "img2img"), cfg, backend, add_routes,
                             title="onecard img2img", open_paths=frozenset({"/internal/ping"}))


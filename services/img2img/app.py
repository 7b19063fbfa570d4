"""The img2img service: POST /api/v1/img2img, and the AUTOMATIC1111 webui API (webui.py),
written with the public API (``import onecard``).

Every route goes through the runtime's pipeline. decode: the parameters, the pictures'
headers and the cost, then the picture(s) and the backend's prepare (resize to the
model's size, batching key), in the CPU pool. predict: the backend's batch, stopped between
steps when every item's client has gone. encode: the backend's post-processing, the mask,
the final size and the output format, in the CPU pool too.
"""

from __future__ import annotations

import uuid
from functools import cached_property
from typing import Any

import numpy as np
from PIL import Image
from pydantic import Field

import onecard
from onecard import Error
from services.img2img.params import Img2ImgItem, Img2ImgParams, parse_style, resolve_seed
from services.img2img.progress import Progress
from services.img2img.settings import Img2ImgSettings

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


class Img2ImgJsonResult(onecard.Params):
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
            raise Error(422, "invalid_parameter", f"steps: at most {self.cfg.max_steps} on this service")
        return steps

    def check_prompts(self, *texts: str) -> None:
        for name, text in zip(("prompt", "negative_prompt"), texts, strict=False):
            if len(text) > self.cfg.max_prompt_chars:
                raise Error(422, "invalid_parameter",
                                    f"{name}: at most {self.cfg.max_prompt_chars} characters")

    def check_size(self, width: int, height: int, what: str = "image") -> None:
        side = self.backend.min_image_side
        if min(width, height) < side:
            raise Error(422, "image_too_small",
                                f"{what}: {width}x{height}: both sides need at least {side} px")

    def prepare(self, item: Img2ImgItem) -> Img2ImgItem:
        self.backend.prepare(item)
        return item

    def finish(self, item: Img2ImgItem, out: np.ndarray) -> np.ndarray:
        """Backend post-processing and the final size. (A webui mask's overlay, which keeps the
        original outside the mask pixel for pixel, is applied by the webui route: webui_images.)"""
        return onecard.resize_image(self.backend.postprocess(item, out), item.out_size)

    # ---- POST /api/v1/img2img ---------------------------------------------------------
    def model_pixels(self, width: int, height: int) -> int:
        """Pixels the model sees for a picture of this size (fitted to max_side)."""
        scale = min(1.0, self.cfg.max_side / max(width, height))
        return max(1, round(width * scale)) * max(1, round(height * scale))

    @staticmethod
    def wants_json(p: Img2ImgParams, request: onecard.Request) -> bool:
        return p.response_format == "json" or request.wants_json()

    def decode_native(self, request: onecard.Request) -> Img2ImgItem:
        """Parameters, the pictures' headers, sizes and the cost, then the pixels (decoded once)."""
        p = request.params()
        header = request.image_header()
        style_header = request.image_header("style_image", required=False)
        self.check_prompts(p.prompt, p.negative_prompt)
        self.check_size(header.width, header.height)
        if style_header is not None:
            self.check_size(style_header.width, style_header.height, "style_image")
        fmt = request.answer_format(p.format, self.cfg.default_format)
        onecard.check_encodable(header.width, header.height, fmt,
                                f"the answer (the picture's own size) in {fmt!r}")
        request.cost(items=1, item_pixels=self.model_pixels(header.width, header.height),
                     input_pixels=header.decode_pixels + (style_header.decode_pixels if style_header else 0),
                     output_pixels=header.pixels, base64_output=self.wants_json(p, request), answer_format=fmt)
        rgb = request.image(max_side=self.cfg.max_side)
        style_rgb = request.image("style_image", max_side=512) if style_header is not None else None
        item = Img2ImgItem(Image.fromarray(rgb), p.prompt, p.negative_prompt, p.strength, self.steps(p.steps),
                           p.guidance_scale, resolve_seed(p.seed), (header.width, header.height),
                           style_weights=parse_style(p.style), style_rgb=style_rgb, job=uuid.uuid4().hex[:12])
        self.prepare(item)
        request.state.item = item
        request.state.answer = {"format": fmt, "quality": p.quality, "json": self.wants_json(p, request)}
        return item

    def encode_native(self, result: np.ndarray, request: onecard.Request) -> onecard.Response:
        item, opts = request.state.item, request.state.answer
        out = self.finish(item, result)
        data, mime = onecard.encode_image(out, opts["format"], opts["quality"])
        headers = {"X-Seed": str(item.seed)}
        if opts["json"]:
            return onecard.Response({"image": onecard.encode_base64(data), "seed": item.seed, "width": out.shape[1],
                                     "height": out.shape[0], "format": opts["format"]}, headers=headers)
        return onecard.Response(data, mime, headers=headers)

    def native_route(self) -> onecard.Route:
        return onecard.Route(
            "/api/v1/img2img", self.decode_native, self.encode_native, summary="Transform an image",
            tags=["img2img"], image_fields=("image", "style_image"), params=Img2ImgParams,
            description="The picture as a raw body (`image/*`), a multipart field `image` (and optionally "
                        "`style_image`), or base64 in JSON. Parameters in the query string, the form or the JSON "
                        "object. The answer is the picture (format from `format`, else `Accept`, else the "
                        "service's default), or JSON with `response_format=json` or `Accept: application/json`.",
            request_body={"required": True, "content": {
                "image/jpeg": BINARY, "image/png": BINARY, "image/webp": BINARY, "image/bmp": BINARY,
                "application/json": {"schema": onecard.openapi_schema(Img2ImgJsonBody)},
                "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
                    "image": {"type": "string", "format": "binary"},
                    "style_image": {"type": "string", "format": "binary"}}}}}},
            responses={200: {"description": "the transformed picture (seed in X-Seed)",
                             "headers": {"X-Seed": {"schema": {"type": "integer"}}},
                             "content": {"image/png": BINARY, "image/jpeg": BINARY, "image/webp": BINARY,
                                         "application/json": {"schema": onecard.openapi_schema(Img2ImgJsonResult)}}}})


class Img2Img(onecard.Model):
    """img2img on one card: the fast style-transfer networks, or Stable Diffusion (diffusers)."""

    Settings = Img2ImgSettings
    batching = True
    cancellable = True       # a diffusion stops between steps when every item's client has gone
    settings: Img2ImgSettings

    @property
    def name(self) -> str:  # the backend names the model label: img2img/style/multistyle26
        return self.settings.backend

    @property
    def uses_torch(self) -> bool:
        return self.settings.backend == "diffusers"

    @cached_property
    def progress(self) -> Progress:
        return Progress()

    @cached_property
    def backend(self):
        return make_backend(self.settings, self.progress)

    @cached_property
    def routes(self) -> Img2ImgRoutes:
        return Img2ImgRoutes(self.settings, self.backend, self.progress)

    def setup(self, ctx: onecard.Setup) -> None:
        self.backend.load(ctx)
        self.device = self.backend.device

    def warmup_inputs(self) -> list[Any]:
        return self.backend.warmup_items()

    def predict(self, items: list[Any], call: onecard.Call) -> list[Any]:
        return self.backend.infer_batch(items, call)

    def batch_key(self, item: Any) -> Any:
        return item.key

    def item_pixels(self, item: Any) -> int:
        own = getattr(self.backend, "item_pixels", None)
        return own(item) if own is not None else super().item_pixels(item)

    def item_work(self, item: Any) -> float:
        own = getattr(self.backend, "item_work", None)
        return own(item) if own is not None else super().item_work(item)

    def on_out_of_memory(self) -> None:
        free = getattr(self.backend, "on_out_of_memory", None)
        if free is not None:
            free()

    def gpu_memory_bytes(self) -> int | None:
        held = getattr(self.backend, "gpu_memory_bytes", None)
        return held() if held is not None else None

    def info(self) -> dict[str, Any]:
        return self.backend.info()

    def add_routes(self, service: onecard.Service) -> None:
        from services.img2img import webui
        service.add_route(self.routes.native_route())
        webui.add_routes(service, self.routes)
        service.open_path("/internal/ping")  # webui clients ping without credentials, as the webui lets them


create_app = onecard.serve(Img2Img, route=None, title="onecard img2img")

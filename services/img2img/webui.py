"""The AUTOMATIC1111 webui API's generation routes (img2img, txt2img), and where every
other webui route is added.

img2img and txt2img go through the runtime's pipeline like every model route. A request
brings ``batch_size x n_iter`` items seeded ``seed, seed+1, ...`` as the webui seeds them,
which the scheduler batches (with each other and with compatible requests). Masks are
prepared as the webui prepares them (webui_images), and outside the mask the answer is
the original picture, pixel for pixel.

The decode hook refuses what cannot be done before any picture is decoded, in this
order: the body's fields (webui_models; text that is not Unicode, webui_json), then the
counts (init images against batch_size, images against max_images), then the cost
(``check_cost``: where a cost model plugs in), and only then the pictures. What the
model and the encoder can take is known there too: a size the output format cannot hold
is a 422 before the model runs, and a picture too thin for the model is widened to what
it takes (the backend's fit).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any

from PIL import Image

import onecard
from onecard import Error, ImageHeader
from services.img2img import webui_images as wi
from services.img2img import webui_infotext
from services.img2img import webui_schemas as ws
from services.img2img.params import MAX_SEED, Img2ImgItem
from services.img2img.webui_info import WebuiState, info_document, infotext, sdapi_error
from services.img2img.webui_json import picture_bytes, read_webui_json
from services.img2img.webui_models import WebuiBase, WebuiImg2Img, WebuiTxt2Img, echoed_parameters
from services.img2img.webui_options import OUTPUT_FORMATS

ROUTE_ERRORS = (400, 401, 404, 413, 415, 422, 500, 503, 504)


def _random_seed() -> int:
    return random.randrange(MAX_SEED)


class WebuiRoutes:
    def __init__(self, routes, state: WebuiState):
        self.r, self.state = routes, state  # routes: app.Img2ImgRoutes

    # ---- shared -----------------------------------------------------------------------
    def _options(self, req: WebuiBase) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """(the options this request runs with, the overrides to keep afterwards, what is ignored)."""
        over = dict(req.override_settings or {})
        ignored = []
        if "sd_model_checkpoint" in over and not self.state.is_this_model(over["sd_model_checkpoint"]):
            over.pop("sd_model_checkpoint")  # as the webui does with a checkpoint it cannot find
            ignored.append("override_settings.sd_model_checkpoint")
        over = self.state.checked(over, "override_settings.")
        keep = {}
        if req.override_settings_restore_afterwards is False and over:
            # kept after the request: bounded as a POST /sdapi/v1/options is, refused now rather than after the model
            keep = self.state.store.check(over, "override_settings.")
        opts = {**self.state.options, **over}
        if opts.get("CLIP_stop_at_last_layers", 1) != 1:
            ignored.append("CLIP_stop_at_last_layers")
        return opts, keep, ignored

    @staticmethod
    def _refuse_scripts(req: WebuiBase) -> None:
        """As the webui answers for a script it does not have; any entry, in a dict or a list."""
        scripts = [req.script_name] if req.script_name else []
        always = req.alwayson_scripts
        if isinstance(always, dict):
            scripts += list(always)
        elif isinstance(always, list):
            scripts += [entry if isinstance(entry, str) else json.dumps(entry)[:64] for entry in always]
        if scripts:
            raise Error(422, "script_not_found", f"Script {str(scripts[0])[:64]!r} not found: this service "
                                                    f"runs no scripts (see /sdapi/v1/scripts)")

    def _plan(self, req: WebuiBase, kind: str) -> dict[str, Any]:
        """Everything a request's fields decide, before any picture is read."""
        self._refuse_scripts(req)
        prompt, negative = req.prompt or "", req.negative_prompt or ""
        self.r.check_prompts(prompt, negative)
        sampler, key, schedule = self.state.sampler(req.sampler_name or req.sampler_index, req.scheduler)
        opts, keep, ignored = self._options(req)
        width, height = req.width, req.height  # None: the first init image's size (img2img)
        if width and height and width * height > self.r.cfg.max_pixels:
            raise Error(413, "too_many_pixels", f"width x height = {width * height} is over the limit of "
                                                   f"{self.r.cfg.max_pixels}")
        fmt = OUTPUT_FORMATS[str(opts.get("samples_format", "png")).lower()]
        if width and height and req.send_images is not False:
            onecard.check_encodable(width, height, fmt, f"width x height {width}x{height} in samples_format {fmt!r}")
        return {"req": req, "kind": kind, "prompt": prompt, "negative_prompt": negative,
                "sampler": sampler, "scheduler_key": key, "schedule": schedule,
                "cfg_scale": req.cfg_scale if req.cfg_scale is not None else 7.0, "format": fmt,
                "width": width, "height": height, "options": opts, "keep_options": keep,
                "ignored": sorted([*(req.model_extra or {}).keys(), *ignored]), "extra": {},
                "job": uuid.uuid4().hex, "job_timestamp": time.strftime("%Y%m%d%H%M%S")}

    def _count(self, gen: dict[str, Any], batch_size: int) -> None:
        """The images a request asks for, against max_images; and their seeds."""
        req = gen["req"]
        n = batch_size * (req.n_iter or 1)
        if n > self.r.cfg.max_images:
            raise Error(422, "invalid_parameter", f"batch_size x n_iter: {n} images is over this service's "
                                                     f"max_images of {self.r.cfg.max_images}")
        seed = req.seed if req.seed is not None and req.seed >= 0 else _random_seed()
        subseed = req.subseed if req.subseed is not None and req.subseed >= 0 else _random_seed()
        gen.update(n=n, batch_size=batch_size, seeds=[seed + i for i in range(n)],
                   subseeds=[subseed + i for i in range(n)])

    def check_cost(self, request: onecard.Request, gen: dict[str, Any], pictures: list[tuple[bytes, ImageHeader]] = (),
                   mask: tuple[bytes, ImageHeader] | None = None) -> None:
        """What the request will cost, stated before any picture is decoded (from the headers):
        n items at the generation size as the model sees it, the pictures decoded, the answers
        produced and sent as base64 (the runtime's cost model checks the products)."""
        width, height, n = gen["width"], gen["height"], gen["n"]
        own_size = bool(gen.get("own_size")) and pictures  # inpainting at the picture's own size
        answer = max(h.pixels for _, h in pictures) if own_size else width * height
        sent = gen["req"].send_images is not False
        request.cost(items=n, item_pixels=self.r.model_pixels(width, height),
                     input_pixels=sum(h.decode_pixels for _, h in pictures) + (mask[1].decode_pixels if mask else 0),
                     output_pixels=n * answer, base64_output=True, output_bytes=None if sent else 4096,
                     answer_format=gen["format"])

    def _steps(self, gen: dict[str, Any], strength: float) -> int:
        """The steps the model runs: with img2img_fix_steps, enough that `steps` of them denoise."""
        steps = gen["steps"]
        if not gen["options"].get("img2img_fix_steps") or not 0.0 < strength < 1.0:
            return steps
        needed = steps / min(strength, 0.999)  # inf for a strength too small to be a float divisor
        if not needed <= self.r.cfg.max_steps:
            raise Error(422, "invalid_parameter", f"img2img_fix_steps: {steps} steps at denoising_strength "
                                                     f"{strength:g} would run {needed:.4g} steps; this service runs "
                                                     f"at most {self.r.cfg.max_steps}")
        return int(needed)

    def _finish_plan(self, request: onecard.Request, gen: dict[str, Any], items: list[Img2ImgItem]) -> list:
        self.r.progress.expect(gen["job"], gen["kind"], len(items), gen["batch_size"])
        gen["items"] = items
        request.state.gen = gen
        return items

    # ---- img2img ----------------------------------------------------------------------
    def decode_img2img(self, request: onecard.Request) -> list[Img2ImgItem]:
        # fields
        doc = webui_infotext.apply(read_webui_json(request), img2img=True)
        req = WebuiImg2Img.from_fields(doc)
        gen = self._plan(req, "img2img")
        strength = req.denoising_strength if req.denoising_strength is not None else 0.75
        gen["strength"] = strength
        gen["steps"] = self.r.steps(req.steps)
        run_steps = self._steps(gen, strength)
        gen["extra"]["Denoising strength"] = strength
        # counts: the webui runs one image per init image in each batch
        count, batch_size = len(req.init_images), req.batch_size or 1
        if count > 1:
            if count > batch_size:
                raise Error(422, "invalid_parameter",
                               f"init_images: {count} images for a batch_size of {batch_size}; send at most "
                               f"batch_size images")
            batch_size = count
        self._count(gen, batch_size)
        # pictures: headers first (sizes, limits, cost), then the pixels
        pictures = self._probe_inits(request, req, gen)
        mask = self._probe(request, req.mask, "mask") if req.mask else None
        self.check_cost(request, gen, pictures, mask)
        inits = [Image.fromarray(request.decode_image(data, header, max_side=self._reduce_to(req)))
                 for data, header in pictures]
        prepared = self._prepare_inits(request, req, inits, gen, mask)
        gen["overlays"] = []
        weights = None if self.state.diffusers else self.state.style_weights(req, gen["options"])
        items = []
        for i in range(gen["n"]):
            image, mask, overlay = prepared[i % batch_size if len(inits) > 1 else 0]
            item = Img2ImgItem(image, gen["prompt"], gen["negative_prompt"], strength, run_steps, gen["cfg_scale"],
                               gen["seeds"][i], (gen["width"], gen["height"]), style_weights=weights,
                               sampler=gen["scheduler_key"], size=None, mask=mask, job=gen["job"])
            items.append(self.r.prepare(item))
            gen["overlays"].append(overlay)
        return self._finish_plan(request, gen, items)

    def _probe(self, request: onecard.Request, text: Any, name: str) -> tuple[bytes, ImageHeader]:
        data = picture_bytes(text, name, self.r.cfg.max_body_bytes)
        return data, request.probe_image(data)

    @staticmethod
    def _reduce_to(req: WebuiImg2Img) -> int | None:
        """A big picture may decode at reduced scale, unless the answer keeps the original's pixels."""
        full_size = bool(req.mask and req.inpaint_full_res)
        return None if full_size else 2 * max(req.width or 0, req.height or 0) or None

    def _probe_inits(self, request: onecard.Request, req: WebuiImg2Img,
                     gen: dict[str, Any]) -> list[tuple[bytes, ImageHeader]]:
        """Every init image's bytes and header; sizes checked (the model's, the encoder's) before decoding."""
        full_size = bool(req.mask and req.inpaint_full_res)  # the answer keeps the original's pixels
        gen["own_size"] = full_size
        pictures = []
        for i, text in enumerate(req.init_images):
            data, header = self._probe(request, text, f"init_images.{i}")
            self.r.check_size(header.width, header.height, f"init_images.{i}")
            if full_size and req.send_images is not False:
                onecard.check_encodable(header.width, header.height, gen["format"],
                                f"init_images.{i} inpainted at its own size ({header.width}x{header.height}) "
                                f"in samples_format {gen['format']!r}")
            pictures.append((data, header))
        if not gen["width"] or not gen["height"]:  # null in the body: the picture's size, as the webui takes it
            first = pictures[0][1]
            width, height = gen["width"] or first.width, gen["height"] or first.height
            if width * height > self.r.cfg.max_pixels:
                raise Error(413, "too_many_pixels", f"width x height = {width * height} is over the limit of "
                                                       f"{self.r.cfg.max_pixels}")
            if req.send_images is not False:
                onecard.check_encodable(width, height, gen["format"],
                                        f"{width}x{height} in samples_format {gen['format']!r}")
            gen["width"], gen["height"] = width, height
        return pictures

    def _prepare_inits(self, request: onecard.Request, req: WebuiImg2Img, inits: list[Image.Image],
                       gen: dict[str, Any], probed_mask: tuple[bytes, ImageHeader] | None):
        """Per init image: (what the model starts from, its mask or None, the overlay or None)."""
        size, mode = (gen["width"], gen["height"]), req.resize_mode or 0
        if not req.mask:
            return [(wi.resize_image(img, size, mode), None, None) for img in inits]
        blur_x = req.mask_blur if req.mask_blur is not None else (req.mask_blur_x or 0)
        blur_y = req.mask_blur if req.mask_blur is not None else (req.mask_blur_y or 0)
        data, header = probed_mask
        source = wi.mask_channel(data, request.decode_image(data, header))
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
    def decode_txt2img(self, request: onecard.Request) -> list[Img2ImgItem]:
        if not getattr(self.r.backend, "supports_text_to_image", False):
            raise Error(422, "unsupported", f"txt2img needs the diffusers backend; this service runs "
                                               f"{self.r.backend.name!r}, which only transforms a picture")
        doc = webui_infotext.apply(read_webui_json(request), img2img=False)
        req = WebuiTxt2Img.from_fields(doc)
        gen = self._plan(req, "txt2img")
        gen["width"], gen["height"] = gen["width"] or 512, gen["height"] or 512
        if req.enable_hr:
            gen["ignored"] = sorted([*gen["ignored"], "enable_hr"])  # no second, upscaled pass here
        gen["strength"] = req.denoising_strength
        gen["steps"] = self.r.steps(req.steps)
        self._count(gen, req.batch_size or 1)
        self.check_cost(request, gen)
        width, height, side = gen["width"], gen["height"], self.r.cfg.max_side
        scale = min(1.0, side / max(width, height))
        size = (max(8, round(width * scale)), max(8, round(height * scale)))
        gen["overlays"] = [None] * gen["n"]
        items = [self.r.prepare(Img2ImgItem(None, gen["prompt"], gen["negative_prompt"], 1.0, gen["steps"],
                                            gen["cfg_scale"], gen["seeds"][i], (width, height),
                                            sampler=gen["scheduler_key"], size=size, job=gen["job"]))
                 for i in range(gen["n"])]
        return self._finish_plan(request, gen, items)

    # ---- the answer -------------------------------------------------------------------
    def encode(self, results: list[Any], request: onecard.Request) -> dict[str, Any]:
        gen = request.state.gen
        req = gen["req"]
        opts = gen["options"]
        if gen["keep_options"]:  # override_settings_restore_afterwards = false: they stay once it has run
            self.state.update_options(gen["keep_options"], "override_settings.")
        produced = [i for i, out in enumerate(results) if out is not None]  # None: interrupted before it ran
        gen["produced"] = produced or [0]
        images = []
        if req.send_images is not False:
            for i in produced:
                img = Image.fromarray(self.r.finish(gen["items"][i], results[i]))
                if gen["overlays"][i] is not None:
                    img = gen["overlays"][i].apply(img)
                text = infotext(gen, self.state, i) if opts.get("enable_pnginfo", True) else None
                images.append(webui_infotext.encode_picture(img, gen["format"], opts.get("jpeg_quality", 80), text))
        info = info_document(gen, self.state)
        info["ignored_fields"] = gen["ignored"]
        parameters = echoed_parameters(req)
        if gen["kind"] == "img2img" and not req.include_init_images:
            parameters["init_images"] = None
            parameters["mask"] = None
        return {"images": images, "parameters": parameters, "info": json.dumps(info)}

    def route(self, kind: str) -> onecard.Route:
        decode = self.decode_img2img if kind == "img2img" else self.decode_txt2img
        model = WebuiImg2Img if kind == "img2img" else WebuiTxt2Img
        # the pipeline documents every status for a model route: each in the webui's shape here
        return onecard.Route(
            f"/sdapi/v1/{kind}", decode, self.encode, summary=f"AUTOMATIC1111 webui {kind}", tags=["webui"],
            image_fields=(),
            request_body={"required": True, "content": {"application/json": {"schema": onecard.openapi_schema(model)}}},
            responses=ws.responses(ws.GenerationResponse, "images (base64), the parameters, and info (a JSON string)",
                                   errors=ROUTE_ERRORS),
            error_body=sdapi_error)


def add_routes(service: onecard.Service, routes) -> None:
    from services.img2img.webui_extras import ExtrasRoutes
    from services.img2img.webui_routes import add_control_routes
    state = WebuiState(routes)
    web = WebuiRoutes(routes, state)
    service.add_route(web.route("img2img"))
    service.add_route(web.route("txt2img"))
    for route in ExtrasRoutes(routes, state).routes():
        service.add_route(route)
    service.error_shape("/sdapi/", sdapi_error)
    add_control_routes(service, routes, state, routes.cfg.auth_required)

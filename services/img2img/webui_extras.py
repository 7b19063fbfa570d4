"""The webui's picture tools that need no model: ``png-info`` (the infotext a picture
carries) and the extras upscale (``extra-single-image``, ``extra-batch-images``) with
the webui's model-free upscalers, Lanczos and Nearest (None leaves a picture as it is).

Both are pipeline routes: admission, deadlines, metrics and the dry run hold for them.
png-info reads a picture's header and metadata only, never its pixels. An upscale's
items take their turn in the queue (as the webui runs extras under its queue lock) but
cost the model nothing; the resize and the encoding happen in the encode hook, in the
CPU pool, where the pictures are decoded (once: a dry run reads only their headers).
Output sizes are known from the headers, so the pixel budget and the format's limits are
checked before any picture is decoded.

An upscale follows the webui's: by ``upscaling_resize`` (resize_mode 0) or to
``upscaling_resize_w x _h`` (1: the factor that covers both, then a centred crop when
``upscaling_crop``); the result's sides are rounded down to multiples of 8; Nearest
resizes by the factor and Lanczos smooths it to that size, as in the webui; a second
upscaler blends in at ``extras_upscaler_2_visibility``. Face restoration needs a model
this service does not have: a non-zero ``gfpgan_visibility`` or ``codeformer_visibility``
is a 422.
"""

from __future__ import annotations

import html
from typing import Any

from PIL import Image
from pydantic import ConfigDict, Field

import onecard
from onecard import IMAGE_FORMATS, Error, Params, Str
from services.img2img import webui_infotext
from services.img2img import webui_schemas as ws
from services.img2img.params import PassthroughItem
from services.img2img.webui_info import WebuiState, sdapi_error
from services.img2img.webui_json import picture_bytes, read_webui_json
from services.img2img.webui_models import Bool, Float
from services.img2img.webui_options import OUTPUT_FORMATS

UPSCALER_NAMES = ("None", "Lanczos", "Nearest")
ERRORS = (400, 401, 413, 415, 422, 500, 503, 504)


class _ExtrasBase(Params):
    """The webui's ExtrasBaseRequest. Other fields (a client's own bookkeeping) are ignored."""
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    resize_mode: int = Field(0, ge=0, le=1, description="0: by upscaling_resize; 1: to upscaling_resize_w x _h")
    show_extras_results: Bool = True
    gfpgan_visibility: Float = Field(0.0, ge=0.0, le=1.0, description="no face restorer here: only 0")
    codeformer_visibility: Float = Field(0.0, ge=0.0, le=1.0, description="no face restorer here: only 0")
    codeformer_weight: Float = Field(0.0, ge=0.0, le=1.0)
    upscaling_resize: Float = Field(2.0, gt=0.0, le=64.0)
    # a number: the webui's clients compute these (a selection's width x the factor) and send fractions
    upscaling_resize_w: Float = Field(512, ge=1, le=65535)
    upscaling_resize_h: Float = Field(512, ge=1, le=65535)
    upscaling_crop: Bool = True
    upscaler_1: Str = Field("None", max_length=128, description="None, Lanczos or Nearest")
    upscaler_2: Str = Field("None", max_length=128, description="None, Lanczos or Nearest")
    extras_upscaler_2_visibility: Float = Field(0.0, ge=0.0, le=1.0)
    upscale_first: Bool = False


class ExtrasSingleImage(_ExtrasBase):
    image: Str = Field("", description="base64 picture")


class FileData(Params):
    model_config = ConfigDict(extra="ignore")
    data: Str = Field(description="base64 picture")
    name: Str = Field("", max_length=1024)


class ExtrasBatchImages(_ExtrasBase):
    imageList: list[FileData] = Field(min_length=1)


class PngInfoRequest(Params):
    model_config = ConfigDict(extra="ignore")
    image: Str = Field(description="base64 picture (PNG, JPEG, WebP or BMP)")


def _upscaler(name: str, field: str) -> str | None:
    found = next((u for u in UPSCALER_NAMES if u.lower() == name.strip().lower()), None)
    if found is None:
        raise Error(422, "invalid_parameter", f"{field}: upscaler {name[:64]!r} not found; this service has "
                                                 f"{', '.join(UPSCALER_NAMES)} (see /sdapi/v1/upscalers)")
    return None if found == "None" else found


def _header(request: onecard.Request, data: bytes, name: str, max_markers: int) -> onecard.ImageHeader:
    """The header (size as oriented, format, what decoding costs), without decoding a pixel: the
    structure's size bounded (JPEG segments, PNG chunks before the pixels, which Pillow reads
    one by one to open the file), no pixel or scan limit (png-info decodes nothing; the
    extras check the pixels they will decode themselves)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and not webui_infotext.png_chunks_within(data, max_markers):
        raise Error(413, "image_too_complex", f"{name}: more than {max_markers} PNG chunks before its pixels")
    return request.probe_image(data, name, for_decoding=False)


class Upscale:
    """One picture's upscale, planned from its header: the factor, the sizes, the info."""

    def __init__(self, req: _ExtrasBase, width: int, height: int, name: str, decode_pixels: int):
        self.first = _upscaler(req.upscaler_1, "upscaler_1")
        self.second = _upscaler(req.upscaler_2, "upscaler_2") if req.extras_upscaler_2_visibility > 0 else None
        self.visibility = req.extras_upscaler_2_visibility
        self.info: dict[str, Any] = {}
        self.crop_to: tuple[int, int] | None = None
        self.size = (width, height)
        self.input_pixels = decode_pixels  # what decoding it holds
        if self.first is None:
            return
        if req.resize_mode == 1:
            to_w, to_h = int(req.upscaling_resize_w), int(req.upscaling_resize_h)
            self.scale = max(to_w / width, to_h / height)
            self.info["Postprocess upscale to"] = f"{to_w}x{to_h}"
            if req.upscaling_crop:
                self.crop_to = (to_w, to_h)
        else:
            self.scale = req.upscaling_resize
            self.info["Postprocess upscale by"] = _number(req.upscaling_resize)
        self.scaled = (int(width * self.scale), int(height * self.scale))  # before the rounding to 8
        self.size = (self.scaled[0] // 8 * 8, self.scaled[1] // 8 * 8)
        if min(self.size) < 1:
            raise Error(422, "invalid_parameter", f"{name}: {width}x{height} upscaled by {self.scale:g} is "
                                                     f"{self.scaled[0]}x{self.scaled[1]}, under 8 px a side")
        if self.crop_to is not None:
            self.size = self.crop_to
            self.info["Postprocess crop to"] = f"{self.crop_to[0]}x{self.crop_to[1]}"
        self.info["Postprocess upscaler"] = self.first
        if self.second is not None:
            self.info["Postprocess upscaler 2"] = self.second

    @property
    def work_pixels(self) -> int:
        """The largest picture this upscale holds at once (the upscaled one before a crop)."""
        if self.first is None:
            return self.size[0] * self.size[1]
        return max(self.scaled[0] * self.scaled[1], self.size[0] * self.size[1])

    def _one(self, img: Image.Image, upscaler: str) -> Image.Image:
        target = (self.scaled[0] // 8 * 8, self.scaled[1] // 8 * 8)
        if self.scale != 1 and img.width >= target[0] and img.height >= target[1]:
            return img.resize(target, Image.LANCZOS)  # shrinking: the webui goes straight to the size
        resample = Image.NEAREST if upscaler == "Nearest" else Image.LANCZOS
        out = img.resize(self.scaled, resample)
        return out if out.size == target else out.resize(target, Image.LANCZOS)

    def apply(self, img: Image.Image) -> Image.Image:
        if self.first is None:
            return img
        out = self._one(img, self.first)
        if self.second is not None:
            out = Image.blend(out, self._one(img, self.second), self.visibility)
        if self.crop_to is not None:
            canvas = Image.new("RGB", self.crop_to)
            canvas.paste(out, (self.crop_to[0] // 2 - out.width // 2, self.crop_to[1] // 2 - out.height // 2))
            out = canvas
        return out

    def infotext(self) -> str:
        return ", ".join(k if k == v else f"{k}: {webui_infotext.quote(v)}" for k, v in self.info.items())


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


class ExtrasRoutes:
    def __init__(self, routes, state: WebuiState):
        self.r, self.state = routes, state  # routes: app.Img2ImgRoutes

    # ---- png-info ---------------------------------------------------------------------
    def decode_png_info(self, request: onecard.Request) -> list[PassthroughItem]:
        req = PngInfoRequest.from_fields(read_webui_json(request))
        data = picture_bytes(req.image.strip(), "image", self.r.cfg.max_body_bytes)
        if not data:
            raise Error(400, "empty_image", "image: the picture is empty")
        _header(request, data, "image", self.r.cfg.max_image_markers)  # format, size and structure within limits
        try:
            text, items = webui_infotext.read_info(webui_infotext.open_metadata(data, IMAGE_FORMATS),
                                                   self.r.cfg.max_info_chars)
        except Exception as exc:  # noqa: BLE001 - unreadable metadata is the caller's data
            raise Error(400, "corrupt_image", f"image: cannot read its metadata: {exc}") from None
        request.state.png_info = {"info": text, "items": items}
        return [PassthroughItem()]

    def encode_png_info(self, results: list[Any], request: onecard.Request) -> dict[str, Any]:
        info = request.state.png_info["info"]
        return {"info": info, "items": request.state.png_info["items"],
                "parameters": webui_infotext.parse(info) if info else {}}

    # ---- extras -----------------------------------------------------------------------
    def _plan(self, request: onecard.Request, req: _ExtrasBase, pictures: list[tuple[str, Any]]) -> dict[str, Any]:
        """Headers read, upscales planned and every limit checked; nothing decoded yet."""
        cfg = self.r.cfg
        if req.gfpgan_visibility > 0 or req.codeformer_visibility > 0:
            which = "gfpgan_visibility" if req.gfpgan_visibility > 0 else "codeformer_visibility"
            raise Error(422, "invalid_parameter", f"{which}: this service has no face restorer (see "
                                                     f"/sdapi/v1/face-restorers); send 0")
        if len(pictures) > cfg.max_images:
            raise Error(422, "invalid_parameter", f"imageList: {len(pictures)} pictures is over this service's "
                                                     f"max_images of {cfg.max_images}")
        fmt = OUTPUT_FORMATS[str(self.state.options.get("samples_format", "png")).lower()]
        plans, total = [], 0
        for name, text in pictures:
            data = picture_bytes(text, name, cfg.max_body_bytes)
            if not data:
                raise Error(400, "empty_image", f"{name}: the picture is empty")
            header = _header(request, data, name, cfg.max_image_markers)
            width, height, source_format = header.width, header.height, header.format
            if width * height > cfg.max_pixels:
                raise Error(413, "too_many_pixels", f"{name}: {width}x{height} = {width * height} pixels is over "
                                                       f"the limit of {cfg.max_pixels}")
            up = Upscale(req, width, height, name, header.decode_pixels)
            total += width * height + up.work_pixels
            if total > cfg.max_pixels:
                raise Error(413, "too_many_pixels", f"{name}: the pictures and their upscales hold {total} pixels "
                                                       f"so far, over this request's limit of {cfg.max_pixels} "
                                                       f"(max_pixels)")
            onecard.check_encodable(*up.size, fmt, f"{name} upscaled to {up.size[0]}x{up.size[1]} in samples_format "
                                           f"{fmt!r}")
            plans.append((name, data, source_format, up))
        return {"format": fmt, "plans": plans}

    def decode_single(self, request: onecard.Request) -> list[PassthroughItem]:
        req = ExtrasSingleImage.from_fields(read_webui_json(request))
        return self._work(req, self._plan(request, req, [("image", req.image)]), single=True, request=request)

    def decode_batch(self, request: onecard.Request) -> list[PassthroughItem]:
        req = ExtrasBatchImages.from_fields(read_webui_json(request))
        pictures = [(f"imageList.{i}.data", f.data) for i, f in enumerate(req.imageList)]
        return self._work(req, self._plan(request, req, pictures), single=False, request=request)

    def _work(self, req: _ExtrasBase, plan: dict[str, Any], single: bool,
              request: onecard.Request) -> list[PassthroughItem]:
        """The pictures stay encoded until the encode hook: nothing waits in the queue at full
        size, and a dry run stops after the headers. The encode hook holds one picture and its
        upscale at a time, and every answer (base64) until it is sent: that is the cost."""
        plans = plan["plans"]
        request.cost(items=1, item_pixels=0,
                     input_pixels=max((up.input_pixels + up.work_pixels for *_, up in plans), default=0),
                     output_pixels=sum(up.size[0] * up.size[1] for *_, up in plans), base64_output=True,
                     answer_format=plan["format"],
                     encoded_pixels=max((up.size[0] * up.size[1] for *_, up in plans), default=0))
        request.state.extras = {"plans": plan["plans"], "format": plan["format"], "single": single}
        return [PassthroughItem()]

    def encode_extras(self, results: list[Any], request: onecard.Request) -> dict[str, Any]:
        opts = self.state.options
        state = request.state.extras
        images, text = [], ""
        for name, data, source_format, up in state["plans"]:
            parameters = None
            if source_format == "PNG" and opts.get("enable_pnginfo", True):  # the webui keeps a picture's infotext
                try:  # (the header was read without its compressed text: Pillow refuses over 64 MB of it)
                    parameters = webui_infotext.open_metadata(data, ("PNG",)).info.get("parameters")
                except Exception as exc:  # noqa: BLE001 - unreadable metadata is the caller's data, as in png-info
                    raise Error(400, "corrupt_image", f"{name}: cannot read its metadata: {exc}") from None
            out = up.apply(Image.fromarray(request.decode_image(data)))
            text = up.infotext()
            keep = parameters if isinstance(parameters, str) else None
            images.append(_encode_extras(out, state["format"], opts.get("jpeg_quality", 80), keep, text))
        html_info = "<p>" + "<br>\n".join(html.escape(line) for line in text.split("\n")) + "</p>"
        if state["single"]:
            return {"html_info": html_info, "image": images[0]}
        return {"html_info": html_info, "images": images}

    def routes(self) -> list[onecard.Route]:
        errors = ERRORS  # the pipeline documents every status for a model route: each in the webui's shape here

        def body(model) -> dict[str, Any]:
            return {"required": True, "content": {"application/json": {"schema": onecard.openapi_schema(model)}}}
        return [
            onecard.Route("/sdapi/v1/png-info", self.decode_png_info, self.encode_png_info, tags=["webui"],
                          image_fields=(),
                       summary="The generation parameters a picture carries (PNG text, JPEG/WebP EXIF)",
                       request_body=body(PngInfoRequest), error_body=sdapi_error,
                       responses=ws.responses(ws.PNGInfoResponse, "the infotext, the other items, the parsed "
                                              "parameters", errors=errors)),
            onecard.Route("/sdapi/v1/extra-single-image", self.decode_single, self.encode_extras, tags=["webui"],
                          image_fields=(),
                       summary="Upscale a picture with a model-free upscaler (Lanczos, Nearest)",
                       request_body=body(ExtrasSingleImage), error_body=sdapi_error,
                       responses=ws.responses(ws.ExtrasSingleImageResponse, "the upscaled picture", errors=errors)),
            onecard.Route("/sdapi/v1/extra-batch-images", self.decode_batch, self.encode_extras, tags=["webui"],
                          image_fields=(),
                       summary="Upscale pictures with a model-free upscaler (Lanczos, Nearest)",
                       request_body=body(ExtrasBatchImages), error_body=sdapi_error,
                       responses=ws.responses(ws.ExtrasBatchImagesResponse, "the upscaled pictures", errors=errors)),
        ]


def _encode_extras(img: Image.Image, fmt: str, quality: int, parameters: str | None, postprocessing: str) -> str:
    """As the webui saves an extras result: the source's infotext kept, the postprocessing added."""
    if fmt != "png":
        return webui_infotext.encode_picture(img, fmt, quality, parameters)
    return webui_infotext.encode_png(img, {key: value for key, value in (("parameters", parameters),
                                                                          ("postprocessing", postprocessing)) if value})

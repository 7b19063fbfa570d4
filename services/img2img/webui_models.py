"""The webui API's request bodies, and what an answer's ``parameters`` echoes.

Defaults are the webui API's. A body may carry any other field (clients send their own
bookkeeping, SillyTavern its credentials): such a field is accepted, named in the
answer's ``info.ignored_fields``, and never echoed. ``parameters`` holds what the webui
declares for the route: our fields as validated, and the webui's other declared fields
(which this service does not apply) with the value the client sent or the webui's
default.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field

import onecard
from onecard import Params, Str, Text
from services.img2img.params import MAX_SEED


def _as_text(value: Any) -> Any:
    """The webui's API model coerces "12" to 12 and 1 to true (the Photoshop plug-in sends its
    seed as a string): a JSON string is read as text is read from a query string. Still
    finite, in range, and a whole number where one is expected."""
    return Text(value) if type(value) is str else value


def _lax_bool(value: Any) -> Any:
    if type(value) is int and value in (0, 1):
        return bool(value)
    return _as_text(value)


# onecard's strict types, each reading a JSON string as text first (pydantic runs the outer
# before-validator first): still finite, in range, and a whole number where one is expected
Int = Annotated[onecard.Int, BeforeValidator(_as_text)]
Float = Annotated[onecard.Float, BeforeValidator(_as_text)]
Bool = Annotated[onecard.Bool, BeforeValidator(_lax_bool)]


class WebuiBase(Params):
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
    sampler_name: Str | None = Field(None, max_length=64, description="absent: sampler_index, else Euler")
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
    infotext: Str | None = Field(None, max_length=100_000,
                                 description="generation parameters text: fills the fields the body leaves out")
    script_name: Str | None = Field(None, max_length=256, description="this service runs no scripts: 422 when set")
    alwayson_scripts: dict[str, Any] | list[Any] | None = Field(
        None, description="this service runs no scripts: 422 for any entry")


class WebuiImg2Img(WebuiBase):
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


class WebuiTxt2Img(WebuiBase):
    enable_hr: Bool | None = False
    denoising_strength: Float | None = Field(None, ge=0.0, le=1.0)


# The webui's other declared request fields (its processing classes' arguments), with
# its defaults: accepted, not applied here, echoed in `parameters` as the webui echoes them.
_WEBUI_DECLARED: dict[str, Any] = {
    "restore_faces": None, "tiling": None, "do_not_save_samples": False, "do_not_save_grid": False, "eta": None,
    "s_min_uncond": None, "s_churn": None, "s_tmax": None, "s_tmin": None, "s_noise": None,
    "refiner_checkpoint": None, "refiner_switch_at": None, "disable_extra_networks": False, "firstpass_image": None,
    "comments": None, "script_args": [],
}
WEBUI_IMG2IMG_DECLARED = {**_WEBUI_DECLARED, "image_cfg_scale": None, "mask_round": True, "latent_mask": None,
                          "initial_noise_multiplier": None}
WEBUI_TXT2IMG_DECLARED = {**_WEBUI_DECLARED, "firstphase_width": 0, "firstphase_height": 0, "hr_scale": 2.0,
                          "hr_upscaler": None, "hr_second_pass_steps": 0, "hr_resize_x": 0, "hr_resize_y": 0,
                          "hr_checkpoint_name": None, "hr_sampler_name": None, "hr_scheduler": None,
                          "hr_prompt": "", "hr_negative_prompt": ""}


def echoed_parameters(req: WebuiBase) -> dict[str, Any]:
    """The answer's `parameters`: the declared fields only, never a field a client merely sent."""
    declared = WEBUI_IMG2IMG_DECLARED if isinstance(req, WebuiImg2Img) else WEBUI_TXT2IMG_DECLARED
    extra = req.model_extra or {}
    out = req.model_dump(exclude=set(extra))
    if out.get("sampler_index") is None:
        out["sampler_index"] = "Euler"  # the webui's declared default
    if out.get("alwayson_scripts") is None:
        out["alwayson_scripts"] = {}
    out.update({name: extra.get(name, default) for name, default in declared.items()})
    return out

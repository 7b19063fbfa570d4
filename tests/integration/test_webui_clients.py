"""The webui API as its real client libraries use it, unchanged (webuiapi 0.9.17,
sd-backend-client 0.5.0), against both backends: the fast style transfer and a tiny
random Stable Diffusion pipeline. Listings, the seed series of batch_size x n_iter,
masks (outside the mask the picture is kept, pixel for pixel), options, errors."""

from __future__ import annotations

import hashlib
import json
import re

import httpx
import numpy as np
import pytest
import webuiapi
from PIL import Image
from sd_backend_client.api.a1111_webservice import A1111Webservice
from sd_backend_client.api.shared_data.backend_options import BackendOption
from sd_backend_client.api.webui.diffusion_request_body import DiffusionRequestBody
from sd_backend_client.api.webui.response_formats import GenerationInfoData

from tests.webui_helpers import box_mask, picture, pixels, webui_service

STATE_KEYS = {"skipped", "interrupted", "stopping_generation", "job", "job_count", "job_timestamp", "job_no",
              "sampling_step", "sampling_steps"}
ERROR_KEYS = {"error", "detail", "body", "errors"}


@pytest.fixture(scope="module", params=["style", "diffusers"])
def svc(request, tmp_path_factory):
    yield from webui_service(request.param, tmp_path_factory)


def client(svc) -> webuiapi.WebUIApi:
    return webuiapi.WebUIApi(baseurl=svc.url + "/sdapi/v1")


def gen_size(svc) -> tuple[int, int]:
    """A picture size the backend generates at without resizing (diffusers: max_side 64, multiples of 8)."""
    return (96, 64) if svc.backend == "style" else (64, 48)


def test_webuiapi_util_helpers_and_listings(svc):
    api = client(svc)
    models = api.get_sd_models()
    assert len(models) == 1 and set(models[0]) == {"title", "model_name", "hash", "sha256", "filename", "config"}
    model = models[0]
    assert model["title"] == f"{model['model_name']} [{model['hash']}]" and model["hash"] == model["sha256"][:10]
    if svc.backend == "style":
        with open(model["filename"], "rb") as fh:  # the real sha256 of the model file
            assert model["sha256"] == hashlib.sha256(fh.read()).hexdigest()
    assert api.util_get_model_names() == [model["title"]]
    assert api.util_get_current_model() == model["title"]
    api.util_set_model(model["model_name"])  # finds the closest title and sets it
    assert api.util_get_current_model() == model["title"]
    assert next(iter(api.get_options())) == "sd_model_checkpoint"
    # both backends list the webui's sampler names (menus are never empty); on the style network
    # they all give the same picture, and it has no schedule type but the automatic one
    names = set(api.util_get_sampler_names())
    assert {"Euler a", "Euler", "DDIM", "DPM++ 2M", "UniPC", "LMS", "Heun", "PLMS"} <= names
    assert all(set(s) == {"name", "aliases", "options"} for s in api.get_samplers())
    if svc.backend == "style":
        assert api.util_get_scheduler_names() == ["automatic"]
    else:
        assert api.util_get_scheduler_names() == ["automatic", "karras"]
    api.util_wait_for_ready(check_interval=0.05)  # idle: returns at once
    assert api.get_upscalers() == [{"name": name, "model_name": None, "model_path": None, "model_url": None,
                                    "scale": 4} for name in ("None", "Lanczos", "Nearest")]
    for empty in (api.get_loras, api.get_hypernetworks, api.get_face_restorers, api.get_realesrgan_models,
                  api.get_prompt_styles, api.get_sd_vae, api.get_latent_upscale_modes):
        assert empty() == [], empty.__name__
    assert api.get_embeddings() == {"loaded": {}, "skipped": {}}
    assert api.get_scripts() == {"txt2img": [], "img2img": []}
    flags = api.get_cmd_flags()
    assert flags["api"] is True and flags["api_auth"] is None and flags["onecard_backend"] == svc.backend
    memory = api.get_memory()
    assert set(memory) == {"ram", "cuda"} and memory["ram"]["total"] >= memory["ram"]["used"] > 0
    assert api.refresh_checkpoints() is None
    assert api.interrupt() == {} and api.skip() is None  # webui's answers; nothing runs, nothing happens
    prog = api.get_progress()
    assert (prog["progress"], prog["eta_relative"], prog["current_image"]) == (0, 0, None)
    assert set(prog["state"]) == STATE_KEYS and prog["state"]["job_count"] == 0
    assert httpx.get(svc.url + "/internal/ping").json() == {}


def test_sd_backend_client_discovery(svc):
    ws = A1111Webservice(svc.url)
    title = client(svc).util_get_current_model()
    assert ws.list_checkpoints() == [BackendOption(name=title.split(" [")[0], display_name=title)]
    assert ws.get_config()["sd_model_checkpoint"] == title
    assert [u.name for u in ws.list_upscalers()] == ["Lanczos", "Nearest"]
    assert (ws.list_vaes(), ws.list_loras(), ws.list_hypernetworks()) == ([], [], [])
    assert BackendOption(name="euler_ancestral", display_name="Euler a") in ws.list_samplers()
    if svc.backend == "style":
        assert [s.display_name for s in ws.list_schedulers()] == ["Automatic"]
    else:
        assert [s.display_name for s in ws.list_schedulers()] == ["Automatic", "Karras"]
    caps = ws.get_capabilities()
    assert (caps.controlnet, caps.ultimate_upscale, caps.soft_inpainting, caps.interrogate) == (False,) * 4
    assert caps.scheduler is True
    body = ws.progress_check()  # validated by the client's own model of the answer
    assert body.state.job_count == 0 and body.current_image is None
    assert ws.interrupt() == {}


def test_img2img_batch_size_and_n_iter_give_the_seed_series(svc):
    api = client(svc)
    w, h = gen_size(svc)
    src = picture(w, h)
    kw = dict(images=[src], width=w, height=h, steps=4, denoising_strength=0.6, prompt="oil painting",
              negative_prompt="blurry")
    r = api.img2img(batch_size=2, n_iter=2, seed=7, **kw)
    assert len(r.images) == 4 and {img.size for img in r.images} == {(w, h)}
    info = r.info
    GenerationInfoData.model_validate(info)  # every field sd-backend-client requires, with its types
    assert (info["seed"], info["all_seeds"], info["batch_size"]) == (7, [7, 8, 9, 10], 2)
    assert info["all_subseeds"] == [info["subseed"] + i for i in range(4)]
    assert info["all_prompts"] == ["oil painting"] * 4 and info["all_negative_prompts"] == ["blurry"] * 4
    assert (info["steps"], info["denoising_strength"], info["cfg_scale"]) == (4, 0.6, 7)
    assert info["sampler_name"] == "Euler a"  # webuiapi's default sampler
    assert (info["width"], info["height"], info["index_of_first_image"]) == (w, h, 0)
    model = api.get_sd_models()[0]
    assert (info["sd_model_name"], info["sd_model_hash"]) == (model["model_name"], model["hash"])
    assert re.fullmatch(r"\d{14}", info["job_timestamp"]) and info["clip_skip"] == 1
    assert info["is_using_inpainting_conditioning"] is False
    assert [re.search(r"Seed: (\d+),", t).group(1) for t in info["infotexts"]] == ["7", "8", "9", "10"]
    assert info["infotexts"][0].startswith("oil painting\nNegative prompt: blurry\nSteps: 4, Sampler: Euler a, ")
    assert f"Model hash: {model['hash']}, Model: {model['model_name']}" in info["infotexts"][0]
    assert "Denoising strength: 0.6" in info["infotexts"][0]
    assert [img.info["parameters"] for img in r.images] == info["infotexts"]  # PNG info, as the webui writes it
    arrays = [pixels(img) for img in r.images]
    if svc.backend == "style":  # a style has no randomness: the same picture four times
        assert all(np.array_equal(a, arrays[0]) for a in arrays)
    else:  # image i is seed 7 + i: the same as that seed alone (float tolerance of a batched call)
        alone = pixels(api.img2img(seed=9, **kw).images[0])
        assert np.abs(alone - arrays[2]).max() <= 3
        assert np.abs(arrays[0] - arrays[2]).mean() > 3
    ws = A1111Webservice(svc.url)
    res = ws.img2img(src, request_body=DiffusionRequestBody(init_images=[src], batch_size=2, seed=3, width=w,
                                                            height=h, steps=3, denoising_strength=0.5))
    assert len(res["images"]) == 2 and res["info"].all_seeds == [3, 4] and res["info"].denoising_strength == 0.5


def test_mask_keeps_the_picture_outside_it(svc):
    api = client(svc)
    src = picture(96, 64)
    mask = box_mask(src.size, (40, 16, 72, 48))
    inside = np.asarray(mask) > 0
    base = pixels(src)
    common = dict(images=[src], mask_image=mask, mask_blur=0, steps=4, seed=1, denoising_strength=1.0,
                  inpainting_fill=1)
    whole = api.img2img(inpaint_full_res=False, width=96, height=64, **common)
    only_masked = api.img2img(inpaint_full_res=True, inpaint_full_res_padding=8, width=64, height=64, **common)
    for r in (whole, only_masked):  # only-masked answers at the picture's own size, as the webui does
        out = pixels(r.images[0])
        assert out.shape == base.shape
        assert np.array_equal(out[~inside], base[~inside])
        assert np.abs(out[inside] - base[inside]).mean() > 5  # the masked part was regenerated
    assert whole.info["extra_generation_params"]["Mask blur"] == 0
    assert only_masked.info["extra_generation_params"]["Inpaint area"] == "Only masked"
    inverted = pixels(api.img2img(inpainting_mask_invert=1, inpaint_full_res=False, width=96, height=64,
                                  **common).images[0])
    assert np.array_equal(inverted[inside], base[inside]) and np.abs(inverted[~inside] - base[~inside]).mean() > 5
    # the webuiapi defaults (blur 4, fill, only masked): kept beyond the blur's reach
    r = api.img2img(images=[src], mask_image=mask, steps=4, seed=1, width=96, height=64)
    default = pixels(r.images[0])
    reach = np.zeros_like(inside)
    reach[16 - 11:48 + 11, 40 - 11:72 + 11] = True
    assert np.array_equal(default[~reach], base[~reach]) and not np.array_equal(default[inside], base[inside])
    # 1 to 3 pixels beside and above/below the mask, the blurred edge (each axis its own) shows the new picture
    sides = np.zeros_like(inside)
    sides[16:48, 40 - 3:40] = sides[16:48, 72:72 + 3] = True
    ends = np.zeros_like(inside)
    ends[16 - 3:16, 40:72] = ends[48:48 + 3, 40:72] = True
    for ring in (sides, ends):
        assert np.abs(default[ring] - base[ring]).mean() > 2
    assert r.info["extra_generation_params"]["Mask blur"] == 4
    painted = Image.new("RGBA", src.size, (255, 255, 255, 0))  # as painted in the webui: alpha is the mask
    painted.putalpha(mask)
    out = pixels(api.img2img(**{**common, "mask_image": painted}, inpaint_full_res=False, width=96,
                             height=64).images[0])
    assert np.array_equal(out[~inside], base[~inside]) and np.abs(out[inside] - base[inside]).mean() > 5
    ws = A1111Webservice(svc.url)
    res = ws.img2img(src, mask, DiffusionRequestBody(init_images=[src], mask=mask, mask_blur=0, width=96, height=64,
                                                     steps=3, denoising_strength=1.0, inpaint_full_res=False))
    out = pixels(res["images"][0])
    assert np.array_equal(out[~inside], base[~inside]) and np.abs(out[inside] - base[inside]).mean() > 5


def test_denoising_strength_zero_keeps_the_picture(svc):
    api = client(svc)
    w, h = gen_size(svc)
    src = picture(w, h)
    r = api.img2img(images=[src], denoising_strength=0, width=w, height=h, steps=4, seed=2)
    assert np.array_equal(pixels(r.images[0]), pixels(src))
    assert r.info["denoising_strength"] == 0 and r.info["all_seeds"] == [2]


def test_include_init_images_and_send_images(svc):
    api = client(svc)
    src = picture(64, 64)
    sent = webuiapi.b64_img(src)
    plain = api.img2img(images=[src], width=64, height=64, steps=2, seed=4)
    assert plain.parameters["init_images"] is None and plain.parameters["mask"] is None and len(plain.images) == 1
    mask = box_mask(src.size, (0, 0, 32, 32))
    echoed = api.img2img(images=[src], mask_image=mask, include_init_images=True, width=64, height=64, steps=2)
    assert echoed.parameters["init_images"] == [sent] and echoed.parameters["mask"] == webuiapi.b64_img(mask)
    assert len(echoed.images) == 1
    silent = api.img2img(images=[src], send_images=False, batch_size=2, width=64, height=64, steps=2, seed=4)
    assert silent.images == [] and silent.info["all_seeds"] == [4, 5]


def test_txt2img(svc):
    api = client(svc)
    if svc.backend == "style":
        with pytest.raises(RuntimeError) as err:
            api.txt2img(prompt="a cat", width=64, height=64, steps=2)
        status, text = err.value.args
        assert status == 422 and json.loads(text)["error"] == "unsupported" and set(json.loads(text)) == ERROR_KEYS
        return
    r = api.txt2img(prompt="a cat", batch_size=2, n_iter=2, seed=11, width=64, height=48, steps=3)
    assert len(r.images) == 4 and {img.size for img in r.images} == {(64, 48)}
    assert r.info["all_seeds"] == [11, 12, 13, 14] and r.info["prompt"] == "a cat"
    GenerationInfoData.model_validate(r.info)
    ws = A1111Webservice(svc.url)
    res = ws.txt2img(DiffusionRequestBody(prompt="a dog", seed=5, width=64, height=64, steps=2, batch_size=2,
                                          sampler="dpmpp_2m", scheduler="karras"))
    assert len(res["images"]) == 2 and res["info"].all_seeds == [5, 6] and res["info"].sampler_name == "DPM++ 2M"
    assert "Schedule type: Karras" in res["info"].infotexts[0]


def test_sdapi_errors_in_the_webui_shape(svc):
    src = webuiapi.b64_img(picture(64, 64))
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json={"init_images": [src], "denoising_strength": 2}, timeout=60)
    doc = r.json()
    assert r.status_code == 422 and set(doc) == ERROR_KEYS and doc["error"] == "invalid_parameter"
    assert doc["detail"].startswith("denoising_strength") and doc["errors"] == f"422: {doc['detail']}"
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json={"init_images": [src], "batch_size": 5, "n_iter": 4})
    assert r.status_code == 422 and "max_images" in r.json()["detail"]
    r = httpx.get(svc.url + "/sdapi/v1/no-such-route")
    assert r.status_code == 404 and r.json() == {"error": "not_found", "detail": "Not Found", "body": "",
                                                 "errors": "404: Not Found"}
    r = httpx.get(svc.url + "/sdapi/v1/img2img")  # a known route, another method: 405, as clients probe
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed" and r.headers["allow"] == "POST"
    r = httpx.post(svc.url + "/sdapi/v1/options", json={"sd_model_checkpoint": "another-model.safetensors"})
    assert r.status_code == 422 and set(r.json()) == ERROR_KEYS and "sd_model_checkpoint" in r.json()["detail"]
    r = httpx.post(svc.url + "/sdapi/v1/options", json=[1, 2])
    assert r.status_code == 422 and set(r.json()) == ERROR_KEYS
    for scripts in ({"script_name": "ultimate sd upscale"}, {"alwayson_scripts": {"ControlNet": {"args": []}}}):
        r = httpx.post(svc.url + "/sdapi/v1/img2img", json={"init_images": [src], **scripts})
        assert r.status_code == 422 and r.json()["error"] == "script_not_found", r.text
    body = {"init_images": [src], "sampler_name": "No Such Sampler", "steps": 2, "width": 64, "height": 64}
    r = httpx.post(svc.url + "/sdapi/v1/img2img", json=body, timeout=60)
    if svc.backend == "style":  # no sampler runs here: any name is accepted and reported
        assert r.status_code == 200 and json.loads(r.json()["info"])["sampler_name"] == "No Such Sampler"
    else:
        assert r.status_code == 404 and r.json()["error"] == "sampler_not_found" and set(r.json()) == ERROR_KEYS


def test_options_round_trip_and_override_settings(svc):
    api = client(svc)
    src = picture(64, 64)
    kw = dict(images=[src], width=64, height=64, steps=2, seed=1)
    try:
        assert api.set_options({"samples_format": "jpg", "onecard_test_key": [1, {"a": 2}]}) is None
        opts = api.get_options()
        assert opts["samples_format"] == "jpg" and opts["onecard_test_key"] == [1, {"a": 2}]
        assert api.img2img(**kw).images[0].format == "JPEG"
        r = api.img2img(override_settings={"samples_format": "webp", "unknown_setting": True}, **kw)
        assert r.images[0].format == "WEBP" and api.get_options()["samples_format"] == "jpg"  # restored
        r = api.img2img(override_settings={"samples_format": "png"}, override_settings_restore_afterwards=False, **kw)
        assert r.images[0].format == "PNG" and api.get_options()["samples_format"] == "png"  # kept
        r = api.img2img(override_settings={"sd_model_checkpoint": "some-other-model"}, **kw)
        assert "override_settings.sd_model_checkpoint" in r.info["ignored_fields"]  # dropped, as the webui does
        bad = httpx.post(svc.url + "/sdapi/v1/img2img", json={"init_images": [webuiapi.b64_img(src)],
                                                              "override_settings": {"samples_format": "gif"}})
        assert bad.status_code == 422 and bad.json()["detail"].startswith("override_settings.samples_format")
        A1111Webservice(svc.url).set_config({"jpeg_quality": 55})
        assert api.get_options()["jpeg_quality"] == 55
    finally:
        api.set_options({"samples_format": "png", "jpeg_quality": 80})
    assert api.img2img(**kw).images[0].format == "PNG"


def test_openapi_documents_the_webui_routes(svc):
    doc = httpx.get(svc.url + "/openapi.json").json()
    for path in ("/sdapi/v1/img2img", "/sdapi/v1/txt2img", "/sdapi/v1/progress", "/sdapi/v1/interrupt",
                 "/sdapi/v1/skip", "/sdapi/v1/options", "/sdapi/v1/sd-models", "/sdapi/v1/samplers",
                 "/sdapi/v1/schedulers", "/sdapi/v1/upscalers", "/sdapi/v1/embeddings", "/sdapi/v1/loras",
                 "/sdapi/v1/cmd-flags", "/sdapi/v1/memory", "/internal/ping"):
        assert path in doc["paths"], path
    assert "security" not in doc  # no credentials configured here (see test_webui_auth)
    props = doc["paths"]["/sdapi/v1/img2img"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"mask", "inpaint_full_res", "batch_size", "n_iter", "override_settings"} <= set(props["properties"])

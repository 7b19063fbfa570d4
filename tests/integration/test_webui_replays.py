"""Replays of real AUTOMATIC1111 client applications, call for call as their source makes
them (the bodies they send, extra fields and odd types included), asserting the fields
each one reads from the answers. Sources read: Open WebUI
(backend/open_webui/routers/images.py), SillyTavern (src/endpoints/stable-diffusion.js
and public/scripts/extensions/stable-diffusion/index.js), the Photoshop plug-in
(Auto-Photoshop-StableDiffusion-Plugin: utility/session.js, typescripts/session/modes.ts,
utility/sdapi/python_replacement.js, typescripts/util/ts/sdapi.ts), and
text-generation-webui's sd_api_pictures extension. webuiapi and sd-backend-client run
unchanged in test_webui_clients.py."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.models import shared_tiny_sd
from tests.service_harness import ServiceProcess
from tests.webui_helpers import APP, b64, diffusers_settings, picture, pixels, style_settings

USER, PASSWORD = "alice", "s3cret-Pa55"


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    return shared_tiny_sd(tmp_path_factory)


@pytest.fixture(scope="module", params=["style", "diffusers"])
def svc(request, sd_dir, tmp_path_factory):
    settings = style_settings() if request.param == "style" else diffusers_settings(sd_dir)
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp(request.param)) as service:
        service.backend = request.param
        yield service


@pytest.fixture(scope="module")
def guarded_sd(sd_dir, tmp_path_factory):
    """A diffusers unit behind HTTP Basic, as Open WebUI and SillyTavern users run the webui."""
    settings = {**diffusers_settings(sd_dir), "basic_auth_env": "ONECARD_TEST_REPLAY_AUTH"}
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("guarded"),
                        env={"ONECARD_TEST_REPLAY_AUTH": f"{USER}:{PASSWORD}"}) as service:
        yield service


def basic(auth: str) -> str:
    """What the clients send; fetch strips the trailing space of an empty one ("Basic ")."""
    return ("Basic " + base64.b64encode(auth.encode()).decode()).strip()


# ---- Open WebUI -------------------------------------------------------------------------
def test_open_webui(guarded_sd):
    url = guarded_sd.url
    headers = {"authorization": basic(f"{USER}:{PASSWORD}")}  # get_automatic1111_api_auth
    with httpx.Client(timeout=120) as http:
        # verify_url: the options answer 200
        http.get(f"{url}/sdapi/v1/options", headers=headers).raise_for_status()
        assert http.get(f"{url}/sdapi/v1/options", headers={"authorization": ""}).status_code == 401
        # get_models: the id is the title, the name the model_name
        models = [{"id": m["title"], "name": m["model_name"]} for m in
                  http.get(f"{url}/sdapi/v1/sd-models", headers=headers).json()]
        assert len(models) == 1 and models[0]["id"].startswith(models[0]["name"] + " [")
        # set_image_model with the model's name: reads the options, sets the checkpoint, posts them ALL back
        options = http.get(f"{url}/sdapi/v1/options", headers=headers).json()
        model = models[0]["name"]
        assert model != options["sd_model_checkpoint"]
        options["sd_model_checkpoint"] = model
        http.post(f"{url}/sdapi/v1/options", json=options, headers=headers).raise_for_status()
        # get_image_model
        assert http.get(f"{url}/sdapi/v1/options", headers=headers).json()["sd_model_checkpoint"] == models[0]["id"]
        # image_generations: n images at the configured size, AUTOMATIC1111_PARAMS merged in
        data = {"prompt": "a lighthouse", "batch_size": 2, "width": 64, "height": 48, "steps": 3,
                "negative_prompt": "fog", **{"cfg_scale": 6, "sampler_name": "Euler a", "scheduler": "Karras"}}
        res = http.post(f"{url}/sdapi/v1/txt2img", json=data, headers=headers).json()
    assert len(res["images"]) == 2
    for image in res["images"]:  # get_image_data: no ',' in it, so plain base64 of a PNG
        assert "," not in image
        assert Image.open(io.BytesIO(base64.b64decode(image))).size == (64, 48)
    info = json.loads(res["info"])  # stored beside the image as metadata
    assert info["prompt"] == "a lighthouse" and info["negative_prompt"] == "fog" and len(info["all_seeds"]) == 2


# ---- SillyTavern ------------------------------------------------------------------------
def sillytavern_listings(http: httpx.Client, url: str, auth: str) -> dict:
    """The calls SillyTavern's server makes when its Stable Diffusion panel connects."""
    h = {"Authorization": basic(auth)}  # getBasicAuthHeader(request.body.auth)
    out = {}
    assert http.get(f"{url}/sdapi/v1/options", headers=h).is_success  # /ping
    upscalers = [x["name"] for x in http.get(f"{url}/sdapi/v1/upscalers", headers=h).json()]
    latent = [x["name"] for x in http.get(f"{url}/sdapi/v1/latent-upscale-modes", headers=h).json()]
    out["upscalers"] = upscalers[:1] + latent + upscalers[1:]  # 0 = None, then latent, then the others
    vaes = [http.get(f"{url}/sdapi/v1/sd-vae", headers=h), http.get(f"{url}/sdapi/v1/sd-modules", headers=h)]
    out["vaes"] = [x["model_name"] for x in next(r.json() for r in vaes if r.is_success)]  # Promise.allSettled
    out["samplers"] = [x["name"] for x in http.get(f"{url}/sdapi/v1/samplers", headers=h).json()]
    out["schedulers"] = [x["name"] for x in http.get(f"{url}/sdapi/v1/schedulers", headers=h).json()]
    out["models"] = [{"value": x["title"], "text": x["title"]} for x in
                     http.get(f"{url}/sdapi/v1/sd-models", headers=h).json()]
    out["model"] = http.get(f"{url}/sdapi/v1/options", headers=h).json()["sd_model_checkpoint"]  # /get-model
    return out


def test_sillytavern(guarded_sd):
    url, auth = guarded_sd.url, f"{USER}:{PASSWORD}"
    h = {"Authorization": basic(auth)}
    with httpx.Client(timeout=120) as http:
        panel = sillytavern_listings(http, url, auth)
        assert panel["upscalers"][0] == "None" and {"Lanczos", "Nearest"} <= set(panel["upscalers"])
        assert panel["vaes"] == [] and "DDIM" in panel["samplers"] and "karras" in panel["schedulers"]
        assert panel["model"] == panel["models"][0]["value"]
        # /set-model: post the checkpoint, then poll progress until it reads 0 and no job
        assert http.post(f"{url}/sdapi/v1/options", json={"sd_model_checkpoint": panel["model"]},
                         headers={**h, "Content-Type": "application/json"}).is_success
        progress = http.get(f"{url}/sdapi/v1/progress", headers=h).json()
        assert progress["progress"] == 0.0 and progress["state"]["job_count"] == 0
        # /generate: the options (is it Forge?), then the client's whole body to txt2img
        assert "forge_preset" not in http.get(f"{url}/sdapi/v1/options", headers=h).json()
        body = {"url": url, "auth": auth, "prompt": "a knight", "negative_prompt": "lowres", "sampler_name": "DDIM",
                "scheduler": "normal", "steps": 3, "cfg_scale": 7, "width": 64, "height": 64,
                "restore_faces": False, "enable_hr": False, "hr_upscaler": "Latent", "hr_scale": 2.0,
                "denoising_strength": 0.7, "hr_second_pass_steps": 0, "seed": 1234,
                "override_settings": {"CLIP_stop_at_last_layers": 1}, "override_settings_restore_afterwards": True,
                "clip_skip": 1, "save_images": True, "send_images": True, "do_not_save_grid": False,
                "do_not_save_samples": False}
        r = http.post(f"{url}/sdapi/v1/txt2img", json=body, headers={**h, "Content-Type": "application/json"})
        assert r.is_success, r.text
        assert PASSWORD not in r.text and url not in r.text  # its credentials and its URL are never echoed
        data = r.json()
        assert Image.open(io.BytesIO(base64.b64decode(data["images"][0]))).size == (64, 64)  # data.images[0]
        # a client that leaves: it interrupts
        assert http.post(f"{url}/sdapi/v1/interrupt", headers=h).json() == {}
        # a wrong password (or none: ST then sends "Basic " of an empty string) is a 401 it reports
        for wrong in ("alice:nope", ""):
            r = http.post(f"{url}/sdapi/v1/txt2img", json={**body, "auth": wrong},
                          headers={"Authorization": basic(wrong), "Content-Type": "application/json"})
            assert r.status_code == 401 and "detail" in r.json()


# ---- the Photoshop plug-in --------------------------------------------------------------
def convert_metadata_to_json(metadata: str) -> dict:
    """The plug-in's convertMetadataToJson (utility/sdapi/python_replacement.js), as written:
    the last line (minus its last character) split on ',' then ':'."""
    last = metadata.rindex("\n")
    prompt, other = metadata[:last], metadata[last + 1:-1]
    out = dict(zip(("prompt", "negative_prompt"), prompt.split("Negative prompt: "), strict=False))
    for setting in other.split(","):
        key, *value = [s.lstrip() for s in setting.split(":")]
        out[key] = value[0] if value else None
    return out


def test_photoshop_plugin(svc):
    url = svc.url
    w, h = (96, 64) if svc.backend == "style" else (64, 48)
    with httpx.Client(timeout=120) as http:
        # start-up: samplers, upscalers, the options, models, loras, embeddings, scripts
        samplers = [s["name"] for s in http.get(f"{url}/sdapi/v1/samplers").json()]
        assert samplers and "Euler a" in samplers
        hires = ["Latent", *[u["name"] for u in http.get(f"{url}/sdapi/v1/upscalers").json()]]
        assert {"Lanczos", "Nearest"} <= set(hires)
        title = http.get(f"{url}/sdapi/v1/sd-models").json()[0]["title"]
        assert http.post(f"{url}/sdapi/v1/options", json={"sd_model_checkpoint": title}).json() is None
        assert http.post(f"{url}/sdapi/v1/options", json={"inpainting_mask_weight": 0.5}).status_code == 200
        assert http.get(f"{url}/sdapi/v1/loras").json() == [] and \
            list(http.get(f"{url}/sdapi/v1/embeddings").json().get("loaded", {})) == []
        assert http.get(f"{url}/sdapi/v1/scripts").json()["img2img"] == []
        # an inpaint session: getSettings' whole payload, its bookkeeping and a string seed included
        src, mask = picture(w, h), Image.new("L", (w, h), 0)
        mask.paste(255, (w // 4, h // 4, w // 2, h // 2))
        payload = {"selection_info": {"left": 0, "top": 0, "width": w, "height": h}, "inpaint_full_res": False,
                   "inpaint_full_res_padding": 32, "inpainting_fill": 1, "mask_expansion": 0, "mask": b64(mask),
                   "expanded_mask": b64(mask), "denoising_strength": 0.8, "init_images": [b64(src)],
                   "alwayson_scripts": {}, "prompt": "a castle", "negative_prompt": "ugly",
                   "original_prompt": "a castle", "original_negative_prompt": "ugly", "clip_skip": 1, "steps": 3,
                   "sampler_index": "Euler a", "width": w, "height": h, "batch_size": 2, "cfg_scale": 7,
                   "seed": "4321", "mask_blur": 4, "use_sharp_mask": False, "use_prompt_shortcut": False,
                   "prompt_shortcut_ui_dict": {}, "uniqueDocumentId": "doc-7f3a", "mode": "inpaint",
                   "restore_faces": False, "tiling": False}
        r = http.post(f"{url}/sdapi/v1/img2img", json=payload, headers={"Accept": "application/json"})
        assert r.status_code == 200, r.text
        images = r.json()["images"]
        assert len(images) == 2 and "doc-7f3a" not in r.text
        for i, image in enumerate(images):  # each image's metadata through png-info, read its own way
            info = http.post(f"{url}/sdapi/v1/png-info", json={"image": "data:image/png;base64," + image}).json()
            meta = convert_metadata_to_json(info["info"])
            assert meta["Seed"] == str(4321 + i) and meta["prompt"].startswith("a castle")
            assert meta["negative_prompt"].startswith("ugly") and meta["Steps"] == "3"
            out = pixels(Image.open(io.BytesIO(base64.b64decode(image))))
            outside = np.ones((h, w), dtype=bool)  # beyond the blur's reach (mask_blur 4: 11 px) of the selection
            outside[h // 4 - 11:h // 2 + 11, max(0, w // 4 - 11):w // 2 + 11] = False
            assert np.array_equal(out[outside], pixels(src)[outside])  # the layer outside the selection is kept
        progress = http.get(f"{url}/sdapi/v1/progress?skip_current_image=false").json()
        assert {"progress", "current_image"} <= set(progress)
        # the upscale mode: the extras page's payload, the target computed from the selection
        scale = 1.5
        upscale = {"resize_mode": 0, "show_extras_results": True, "gfpgan_visibility": 0,
                   "codeformer_visibility": 0, "codeformer_weight": 0, "upscaling_resize": scale,
                   "upscaling_resize_w": 333 * scale, "upscaling_resize_h": 222 * scale, "upscaling_crop": True,
                   "upscaler_1": "Lanczos", "upscaler_2": "None", "upscale_first": False, "image": b64(src)}
        r = http.post(f"{url}/sdapi/v1/extra-single-image", json=upscale, headers={"Accept": "application/json"})
        assert r.status_code == 200, r.text
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["image"]))).size == \
            (int(w * scale) // 8 * 8, int(h * scale) // 8 * 8)  # r['image']
        assert http.post(f"{url}/sdapi/v1/interrupt").json() == {}


# ---- text-generation-webui's sd_api_pictures --------------------------------------------
def test_text_generation_webui_sd_api_pictures(svc):
    url = svc.url
    with httpx.Client(timeout=120) as http:
        http.get(f"{url}/sdapi/v1/sd-models").raise_for_status()  # SD_api_address_update
        checkpoints = [m["title"] for m in http.get(f"{url}/sdapi/v1/sd-models").json()]  # get_checkpoints
        current = http.get(f"{url}/sdapi/v1/options").json()["sd_model_checkpoint"]
        assert current in checkpoints
        http.post(f"{url}/sdapi/v1/options", json={"sd_model_checkpoint": current})  # load_checkpoint
        assert "DPM++ 2M" in [x["name"] for x in http.get(f"{url}/sdapi/v1/samplers").json()]
        for path in ("reload-checkpoint", "unload-checkpoint"):  # give_VRAM_priority, with json=''
            http.post(f"{url}/sdapi/v1/{path}", json="").raise_for_status()
        payload = {"prompt": "(Masterpiece:1.1), detailed, (a cat:1)", "seed": -1.0, "sampler_name": "DPM++ 2M",
                   "enable_hr": False, "hr_scale": "1.0", "hr_upscaler": "ESRGAN_4x", "denoising_strength": 0.61,
                   "steps": 3, "cfg_scale": 7, "width": 64.0, "height": 64, "restore_faces": False,
                   "override_settings_restore_afterwards": True, "negative_prompt": "(worst quality:1.3)"}
        r = http.post(f"{url}/sdapi/v1/txt2img", json=payload)
        if svc.backend == "style":  # a picture-to-picture network: refused in the webui's shape, which it raises
            assert r.status_code == 422 and r.json()["error"] == "unsupported" and "detail" in r.json()
            return
        r.raise_for_status()
        for img_str in r.json()["images"]:
            image = Image.open(io.BytesIO(base64.b64decode(img_str.split(",", 1)[0])))
            image.thumbnail((300, 300))
            assert image.size == (64, 64)
        assert r.json()["parameters"]["hr_scale"] == "1.0"  # a declared field, echoed as sent

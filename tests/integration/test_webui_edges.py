"""The webui API at the edges of what a client can send: no 5xx, a 4xx naming the field or
the figure, or an answer. Lone surrogates wherever a string goes, numeric extremes,
pictures far from square and sizes over an encoder's limit, MIME-wrapped base64, script
fields, what `parameters` echoes, and the order of the checks (fields, then counts, then
pictures). Both backends, each a real service process."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.webui_helpers import (
    assert_webui_error,
    b64,
    picture,
    pixels,
    webui_service,
)


@pytest.fixture(scope="module", params=["style", "diffusers"])
def svc(request, tmp_path_factory):
    yield from webui_service(request.param, tmp_path_factory)


def post(svc, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(svc.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=120, **kw)


def with_raw(body: dict, raw_field: str) -> bytes:
    """`body` as JSON with one more member written as raw JSON text (a lone surrogate escape
    is valid JSON that json.dumps cannot produce from a Python string)."""
    head = json.dumps(body).encode()[:-1]
    return head + (b", " if body else b"") + raw_field.encode() + b"}"


def options_still_served(svc) -> dict:
    r = httpx.get(svc.url + "/sdapi/v1/options", timeout=10)
    assert r.status_code == 200
    return r.json()


def test_lone_surrogates_are_refused_wherever_a_string_goes(svc):
    src = b64(picture(64, 64))
    base = {"init_images": [src], "width": 64, "height": 64, "steps": 2}
    cases = [
        ("/sdapi/v1/options", {}, r'"k": "caf\ud800e"', "k"),
        ("/sdapi/v1/options", {}, r'"caf\udc00": 1', "caf"),
        ("/sdapi/v1/options", {}, r'"nested": {"a": ["ok", "\ud83d"]}', "nested.a.1"),
        ("/sdapi/v1/img2img", base, r'"prompt": "a \ud800 cat"', "prompt"),
        ("/sdapi/v1/img2img", base, r'"negative_prompt": "\udfff"', "negative_prompt"),
        ("/sdapi/v1/img2img", base, r'"sampler_name": "Euler\ud800"', "sampler_name"),
        ("/sdapi/v1/img2img", base, r'"infotext": "x\nSteps: 2, Sampler: \ud800, Seed: 1"', "infotext"),
        ("/sdapi/v1/img2img", base, r'"styles": ["\ud800"]', "styles.0"),
        ("/sdapi/v1/img2img", base, r'"override_settings": {"k": "\ud800"}', "override_settings.k"),
        ("/sdapi/v1/img2img", {**base, "override_settings_restore_afterwards": False},
         r'"override_settings": {"k": "\ud800"}', "override_settings.k"),
        ("/sdapi/v1/img2img", base, r'"some_client_field": "\ud800"', "some_client_field"),
        ("/sdapi/v1/png-info", {}, r'"image": "\ud800"', "image"),
        ("/sdapi/v1/extra-single-image", {"upscaler_1": "Lanczos"}, r'"image": "AAAA\ud800"', "image"),
    ]
    for path, body, raw, field in cases:
        r = post(svc, path, with_raw(body, raw))
        assert_webui_error(r, 422, "invalid_parameter", field, "surrogate")
        assert options_still_served(svc)  # nothing of it was stored
    # a paired surrogate escape is ordinary text: stored, answered, written into the PNG infotext
    r = post(svc, "/sdapi/v1/options", with_raw({}, r'"onecard_test_emoji": "caf\u00e9 \ud83d\ude00"'))
    assert r.status_code == 200, r.text
    assert options_still_served(svc)["onecard_test_emoji"] == "café \U0001F600"
    r = post(svc, "/sdapi/v1/img2img", {**base, "prompt": "café \U0001F600"})
    assert r.status_code == 200, r.text
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))).info["parameters"].startswith(
        "café \U0001F600\n")


def test_fix_steps_with_tiny_strengths_is_a_422_naming_the_steps(svc):
    src = b64(picture(64, 64))
    body = {"init_images": [src], "width": 64, "height": 64, "steps": 20,
            "override_settings": {"img2img_fix_steps": True}}
    for strength in (5e-324, 1e-300, 1e-5, 0.19):  # 20 / 0.19 = 105 steps: over max_steps 100 (style)
        r = post(svc, "/sdapi/v1/img2img", {**body, "denoising_strength": strength})
        if svc.backend == "diffusers" and strength == 0.19:  # this service allows 1000 steps
            assert r.status_code == 200, r.text
            continue
        assert_webui_error(r, 422, "invalid_parameter", "img2img_fix_steps", "steps")
    # as a stored setting too, and the answer that fits
    try:
        assert post(svc, "/sdapi/v1/options", {"img2img_fix_steps": True}).status_code == 200
        assert_webui_error(post(svc, "/sdapi/v1/img2img", {**body, "override_settings": {},
                                                            "denoising_strength": 5e-324}), 422, "invalid_parameter")
        r = post(svc, "/sdapi/v1/img2img", {**body, "override_settings": {}, "steps": 2, "denoising_strength": 0.5})
        assert r.status_code == 200 and json.loads(r.json()["info"])["steps"] == 2
    finally:
        post(svc, "/sdapi/v1/options", {"img2img_fix_steps": False})


def test_a_strength_that_runs_no_step_gives_the_picture_back(svc):
    src = picture(64, 48) if svc.backend == "diffusers" else picture(96, 64)
    for strength in (5e-324, 0.01):  # 20 steps x 0.01 = 0.2: not one step (diffusers failed on it)
        r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(src)], "width": src.width, "height": src.height,
                                            "steps": 20, "denoising_strength": strength})
        assert r.status_code == 200, r.text
        out = pixels(Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))))
        if svc.backend == "diffusers":
            assert np.array_equal(out, pixels(src))
        else:  # the style blend at that strength: within a few levels of the picture
            assert np.abs(out - pixels(src)).max() <= 3
    native = httpx.post(svc.url + "/api/v1/img2img?strength=0.01&steps=20", content=base64.b64decode(b64(src)),
                        headers={"content-type": "image/png"}, timeout=60)
    assert native.status_code == 200, native.text


def test_pictures_far_from_square_are_answered_at_their_size(svc):
    """The fit no longer shrinks a thin picture below what the model takes (the style
    network's reflect padding failed at 4 px): a 32 x 40000 picture comes back 32 x 40000."""
    for size in ((32, 40000), (40000, 32), (17000, 64)):
        data = base64.b64decode(b64(Image.new("RGB", size, (40, 90, 160))))
        r = httpx.post(svc.url + "/api/v1/img2img?steps=2", content=data, headers={"content-type": "image/png"},
                       timeout=120)
        assert r.status_code == 200, (size, r.text)
        assert Image.open(io.BytesIO(r.content)).size == size
    tall, thinner = b64(picture(100, 1000)), b64(picture(32, 2000))  # filled into 8192x8: a 0 px wide picture
    for src, width, height, mode in ((tall, 8, 8192, 0), (tall, 8192, 8, 2), (tall, 8192, 8, 1), (tall, 8, 8192, 2),
                                     (thinner, 8192, 8, 2)):
        r = post(svc, "/sdapi/v1/img2img", {"init_images": [src], "width": width, "height": height,
                                            "resize_mode": mode, "steps": 2})
        assert r.status_code == 200, (width, height, mode, r.text)
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))).size == (width, height)
    # no size in the body: the picture's own, however thin
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(Image.new("RGB", (32, 40000)))], "width": None,
                                        "height": None, "steps": 2, "send_images": False})
    assert r.status_code == 200 and json.loads(r.json()["info"])["width"] == 32


def test_sizes_over_an_encoders_limit_are_refused_before_the_model_runs(svc):
    before = httpx.get(svc.url + "/stats").json()["served"]
    wide = base64.b64decode(b64(Image.new("RGB", (17000, 64))))
    r = httpx.post(svc.url + "/api/v1/img2img?format=webp", content=wide, headers={"content-type": "image/png"},
                   timeout=60)
    assert r.status_code == 422 and r.json()["error"]["code"] == "output_too_large"
    assert "17000x64" in r.json()["error"]["message"] and "16383" in r.json()["error"]["message"]
    wider = base64.b64decode(b64(Image.new("RGB", (66000, 32))))
    r = httpx.post(svc.url + "/api/v1/img2img?format=jpeg", content=wider, headers={"content-type": "image/png"},
                   timeout=60)
    assert r.status_code == 422 and "65500" in r.json()["error"]["message"]
    src = b64(picture(64, 64))
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [src], "width": 8192, "height": 8, "steps": 2,
                                        "override_settings": {"samples_format": "webp"}})
    assert r.status_code == 200, r.text  # webui sizes stop at 8192: within every format
    # only-masked inpainting answers at the picture's own size: checked against the format too
    mask = b64(Image.new("L", (17000, 64), 255))
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(Image.new("RGB", (17000, 64)))], "mask": mask,
                                        "inpaint_full_res": True, "width": 64, "height": 64, "steps": 2,
                                        "override_settings": {"samples_format": "webp"}})
    assert_webui_error(r, 422, "output_too_large", "17000x64", "16383")
    # the refusals ran nothing on the model
    assert httpx.get(svc.url + "/stats").json()["served"] == before + 1


def test_mime_wrapped_base64_is_read_as_the_webui_reads_it(svc):
    data = base64.b64decode(b64(picture(64, 64)))
    wrapped = base64.encodebytes(data).decode()  # a line break every 76 characters
    assert "\n" in wrapped
    for text in (wrapped, wrapped.replace("\n", "\r\n"), "data:image/png;base64," + wrapped, " " + wrapped + " "):
        r = post(svc, "/sdapi/v1/img2img", {"init_images": [text], "mask": text, "width": 64, "height": 64,
                                            "steps": 2, "denoising_strength": 0})
        assert r.status_code == 200, r.text
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [wrapped.replace("\n", "\n#")], "width": 64, "height": 64})
    assert_webui_error(r, 400, "bad_base64", "init_images.0")  # whitespace is forgiven, garbage is not
    r = post(svc, "/sdapi/v1/img2img", {"init_images": ["https://example.com/a.png"]})
    assert_webui_error(r, 422, "invalid_parameter", "init_images.0", "URL")


def test_scripts_are_refused_in_any_form(svc):
    src = b64(picture(64, 64))
    for scripts in ({"alwayson_scripts": {"ControlNet": {"args": []}}}, {"alwayson_scripts": ["ControlNet"]},
                    {"alwayson_scripts": [{"args": []}]}, {"script_name": "Ultimate SD upscale"}):
        r = post(svc, "/sdapi/v1/img2img", {"init_images": [src], "width": 64, "height": 64, **scripts})
        assert_webui_error(r, 422, "script_not_found", "not found")
    for nothing in ({"alwayson_scripts": {}}, {"alwayson_scripts": []}, {"script_name": ""}, {"script_args": []}):
        r = post(svc, "/sdapi/v1/img2img", {"init_images": [src], "width": 64, "height": 64, "steps": 2, **nothing})
        assert r.status_code == 200, (nothing, r.text)
    assert_webui_error(post(svc, "/sdapi/v1/img2img", {"init_images": [src], "alwayson_scripts": "ControlNet"}),
                       422, "invalid_parameter", "alwayson_scripts")


def test_parameters_echo_the_declared_fields_only(svc):
    src = b64(picture(64, 64))
    body = {"init_images": [src], "width": 64, "height": 64, "steps": 2, "seed": "7", "prompt": "p",
            "auth": "alice:s3cret", "url": "http://127.0.0.1:7860", "uniqueDocumentId": "doc-1",
            "prompt_shortcut_ui_dict": {"k": "v"}, "restore_faces": True, "tiling": False, "eta": 0.5,
            "override_settings": {"unknown_setting": 1}}
    r = post(svc, "/sdapi/v1/img2img", body)
    assert r.status_code == 200, r.text
    doc = r.json()
    params = doc["parameters"]
    assert "s3cret" not in r.text and "7860" not in r.text and "doc-1" not in r.text
    for undeclared in ("auth", "url", "uniqueDocumentId", "prompt_shortcut_ui_dict"):
        assert undeclared not in params
    assert (params["seed"], params["prompt"], params["steps"], params["width"]) == (7, "p", 2, 64)
    assert (params["restore_faces"], params["tiling"], params["eta"]) == (True, False, 0.5)  # declared by the webui
    assert (params["sampler_index"], params["alwayson_scripts"], params["script_args"]) == ("Euler", {}, [])
    assert params["init_images"] is None and params["override_settings"] == {"unknown_setting": 1}
    info = json.loads(doc["info"])
    assert {"auth", "url", "uniqueDocumentId", "restore_faces"} <= set(info["ignored_fields"])  # names only


def test_fields_then_counts_then_pictures(svc):
    """Nothing is decoded before the fields and the counts are known good: with pictures that
    are not even base64, the answer is still the field's or the count's 422."""
    garbage = "not base64 at all #"
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [garbage] * 64, "batch_size": 1})
    assert_webui_error(r, 422, "invalid_parameter", "64 images for a batch_size of 1")
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [garbage], "batch_size": 16, "n_iter": 2})
    assert_webui_error(r, 422, "invalid_parameter", "max_images")
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [garbage], "denoising_strength": 2})
    assert_webui_error(r, 422, "invalid_parameter", "denoising_strength")
    r = post(svc, "/sdapi/v1/img2img", with_raw({"init_images": [garbage]}, r'"prompt": "\ud800"'))
    assert_webui_error(r, 422, "invalid_parameter", "prompt")
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [garbage], "width": 64, "height": 64})
    assert_webui_error(r, 400, "bad_base64", "init_images.0")  # only now is a picture read


def test_numbers_as_the_webui_coerces_them(svc):
    """The webui's API model reads "7" as 7 (the Photoshop plug-in sends its seed as a
    string) and 1 as true; what is not a finite number in range stays a 422."""
    src = b64(picture(64, 64))
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [src], "width": "64", "height": 64.0, "steps": "2",
                                        "seed": "-1", "cfg_scale": "6.5", "include_init_images": 1})
    assert r.status_code == 200, r.text
    assert r.json()["parameters"]["init_images"] == [src]
    for bad in ({"seed": "nan"}, {"seed": "1e999"}, {"steps": "2.5"}, {"cfg_scale": "Infinity"},
                {"seed": "9" * 5000}, {"include_init_images": 2}, {"width": "wide"}):
        r = post(svc, "/sdapi/v1/img2img", {"init_images": [src], **bad})
        assert_webui_error(r, 422, "invalid_parameter", next(iter(bad)))


def test_a_request_that_names_no_sampler_runs_euler_and_the_listings_say_what_the_infotext_says(svc):
    """The webui's default sampler is Euler (its sampler_index default); on diffusers it was
    the model directory's scheduler (DDIM here). Whatever the backend, the sampler and the
    schedule an answer reports are in the listings (the style backend's were empty)."""
    samplers = {s["name"] for s in httpx.get(svc.url + "/sdapi/v1/samplers").json()}
    schedules = {s["label"] for s in httpx.get(svc.url + "/sdapi/v1/schedulers").json()}
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(picture(64, 64))], "width": 64, "height": 64, "steps": 2})
    info = json.loads(r.json()["info"])
    assert info["sampler_name"] == "Euler" and "Sampler: Euler," in info["infotexts"][0]
    assert info["sampler_name"] in samplers
    schedule = next((p.split(": ")[1] for p in info["infotexts"][0].split(", ") if p.startswith("Schedule type")),
                    "Automatic")
    assert schedule in schedules
    for name, expected in (("k_euler_a", "Euler a"), ("DPM++ 2M Karras", "DPM++ 2M")):  # aliases, as the webui
        body = {"init_images": [b64(picture(64, 64))], "width": 64, "height": 64, "steps": 2, "sampler_name": name}
        assert json.loads(post(svc, "/sdapi/v1/img2img", body).json()["info"])["sampler_name"] == expected


def test_infotext_fills_what_the_body_leaves_out(svc):
    text = "a red barn\nNegative prompt: fog\nSteps: 3, Sampler: DDIM, CFG scale: 4.5, Seed: 77, Size: 64x48, " \
           "Denoising strength: 0.5"
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(picture(64, 48))], "infotext": text, "steps": 2})
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert (info["prompt"], info["negative_prompt"], info["seed"], info["cfg_scale"]) == ("a red barn", "fog", 77, 4.5)
    assert (info["steps"], info["width"], info["height"], info["denoising_strength"]) == (2, 64, 48, 0.5)  # body wins
    assert info["sampler_name"] == "DDIM"
    r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(picture(64, 48))],
                                        "infotext": "p\nSteps: x, Seed: 1, Size: 8x8"})
    assert_webui_error(r, 422, "invalid_parameter", "infotext", "Steps")

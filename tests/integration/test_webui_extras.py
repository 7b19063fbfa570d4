"""The webui's model-free picture tools on both backends: png-info (the infotext a picture
carries, PNG text or JPEG/WebP EXIF, parsed as the webui parses it) and the extras
upscale (None, Lanczos, Nearest), through the real clients (webuiapi, sd-backend-client)
and raw requests: sizes as the webui computes them, pixels against Pillow, limits known
from the headers before any picture is decoded."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import httpx
import numpy as np
import pytest
import webuiapi
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from sd_backend_client.api.a1111_webservice import A1111Webservice

from tests.webui_helpers import (
    assert_webui_error,
    b64,
    picture,
    pixels,
    webui_service,
)


@pytest.fixture(scope="module", params=["style", "diffusers"])
def svc(request, tmp_path_factory):
    yield from webui_service(request.param, tmp_path_factory, max_pixels=4_000_000)


def api(svc) -> webuiapi.WebUIApi:
    return webuiapi.WebUIApi(baseurl=svc.url + "/sdapi/v1")


def post(svc, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(svc.url + path, json=body, timeout=60, **kw)


def decoded(text: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(text)))


def test_png_info_reads_back_what_a_generation_wrote(svc):
    w, h = (96, 64) if svc.backend == "style" else (64, 48)
    try:
        for fmt, pil in (("png", "PNG"), ("jpg", "JPEG"), ("webp", "WEBP")):
            assert post(svc, "/sdapi/v1/options", {"samples_format": fmt}).status_code == 200
            r = post(svc, "/sdapi/v1/img2img", {"init_images": [b64(picture(w, h))], "prompt": "a red fox, oil",
                                                "negative_prompt": "blur: none", "seed": 123, "steps": 3, "width": w,
                                                "height": h, "cfg_scale": 5.5}).json()
            sent = r["images"][0]
            assert decoded(sent).format == pil
            written = json.loads(r["info"])["infotexts"][0]
            answer = post(svc, "/sdapi/v1/png-info", {"image": sent}).json()
            assert answer["info"] == written, fmt
            params = answer["parameters"]
            assert (params["Prompt"], params["Negative prompt"]) == ("a red fox, oil", "blur: none")
            assert (params["Seed"], params["Steps"], params["CFG scale"]) == ("123", "3", "5.5")
            assert (params["Size-1"], params["Size-2"]) == (str(w), str(h))
            assert params["Denoising strength"] == "0.75" and params["Clip skip"] == "1"
            # the Photoshop plug-in's way: a data: URL, then the last line split on commas
            doc = post(svc, "/sdapi/v1/png-info", {"image": "data:image/png;base64," + sent}).json()
            assert doc["info"] == written and "Seed: 123" in doc["info"].rsplit("\n", 1)[1]
    finally:
        post(svc, "/sdapi/v1/options", {"samples_format": "png"})


def test_png_info_of_other_pictures(svc):
    plain = post(svc, "/sdapi/v1/png-info", {"image": b64(picture(32, 32))}).json()
    assert plain == {"info": "", "items": {}, "parameters": {}}
    meta = PngInfo()
    meta.add_text("parameters", "hello\nSteps: 20, Sampler: Euler a, Seed: 5, Size: 512x768")
    meta.add_text("Software", "a painter")
    meta.add_itxt("Comment", "ünïcode")
    buf = io.BytesIO()
    picture(32, 32).save(buf, "PNG", pnginfo=meta)
    doc = post(svc, "/sdapi/v1/png-info", {"image": base64.b64encode(buf.getvalue()).decode()}).json()
    assert doc["info"].startswith("hello\n") and doc["items"] == {"Software": "a painter", "Comment": "ünïcode"}
    assert (doc["parameters"]["Sampler"], doc["parameters"]["Size-1"], doc["parameters"]["Size-2"]) == \
        ("Euler a", "512", "768")
    assert_webui_error(post(svc, "/sdapi/v1/png-info", {"image": ""}), 400, "empty_image")
    assert_webui_error(post(svc, "/sdapi/v1/png-info", {"image": base64.b64encode(b"GIF89a....").decode()}), 415,
                       "unsupported_image")
    assert_webui_error(post(svc, "/sdapi/v1/png-info", {"image": base64.b64encode(b"\x89PNG\r\n\x1a\nxx").decode()}),
                       400, "corrupt_image")
    assert_webui_error(post(svc, "/sdapi/v1/png-info", {}), 422, "invalid_parameter", "image")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def test_png_info_refuses_a_chunk_bomb_before_pillow_walks_it(svc):
    data = base64.b64decode(b64(picture(8, 8)))
    ihdr_end = 8 + 25
    bomb = data[:ihdr_end] + _chunk(b"tEXt", b"k\x00v") * 600 + data[ihdr_end:]  # 600 > max_image_markers 512
    r = post(svc, "/sdapi/v1/png-info", {"image": base64.b64encode(bomb).decode()})
    assert_webui_error(r, 413, "image_too_complex", "512")
    fine = data[:ihdr_end] + _chunk(b"tEXt", b"k\x00v") * 10 + data[ihdr_end:]
    assert post(svc, "/sdapi/v1/png-info", {"image": base64.b64encode(fine).decode()}).json()["items"] == {"k": "v"}


def reference_upscale(img: Image.Image, scale: float, resample) -> Image.Image:
    """The webui's Upscaler.upscale for the model-free upscalers: by the factor, then Lanczos
    to the sides rounded down to multiples of 8."""
    scaled = (int(img.width * scale), int(img.height * scale))
    target = (scaled[0] // 8 * 8, scaled[1] // 8 * 8)
    out = img.resize(scaled, resample)
    return out if out.size == target else out.resize(target, Image.LANCZOS)


def test_extras_single_image_upscales_as_the_webui_does(svc):
    src = picture(100, 75)
    for name, resample in (("Lanczos", Image.LANCZOS), ("Nearest", Image.NEAREST)):
        r = api(svc).extra_single_image(src, upscaler_1=name, upscaling_resize=2)
        out = r.image
        assert out.size == (200, 144)  # 150 rounded down to a multiple of 8, as the webui does
        assert np.array_equal(pixels(out), pixels(reference_upscale(src, 2, resample)))
        assert r.info == f"<p>Postprocess upscale by: 2, Postprocess upscaler: {name}</p>"
        assert out.info["postprocessing"] == f"Postprocess upscale by: 2, Postprocess upscaler: {name}"
    assert np.array_equal(pixels(api(svc).extra_single_image(src, upscaler_1="None").image), pixels(src))
    # to a size: the factor that covers both sides, then a centred crop (or not)
    body = {"image": b64(src), "upscaler_1": "Lanczos", "resize_mode": 1, "upscaling_resize_w": 160,
            "upscaling_resize_h": 160}
    assert decoded(post(svc, "/sdapi/v1/extra-single-image", body).json()["image"]).size == (160, 160)
    r = post(svc, "/sdapi/v1/extra-single-image", {**body, "upscaling_crop": False}).json()
    assert decoded(r["image"]).size == (208, 160) and "Postprocess upscale to: 160x160" in r["html_info"]
    # the Photoshop plug-in computes the target from its selection: a fraction is taken as the webui takes it
    r = post(svc, "/sdapi/v1/extra-single-image", {**body, "upscaling_resize_w": 149.5, "upscaling_resize_h": 112.5})
    assert r.status_code == 200 and decoded(r.json()["image"]).size == (149, 112)
    # a second upscaler blended in
    two = post(svc, "/sdapi/v1/extra-single-image", {"image": b64(src), "upscaler_1": "Lanczos", "upscaler_2":
                                                     "Nearest", "extras_upscaler_2_visibility": 0.5}).json()
    expected = Image.blend(reference_upscale(src, 2, Image.LANCZOS), reference_upscale(src, 2, Image.NEAREST), 0.5)
    assert np.array_equal(pixels(decoded(two["image"])), pixels(expected))
    assert "Postprocess upscaler 2: Nearest" in two["html_info"]
    # sd-backend-client's upscale: the first real upscaler, to a size, a data: URL
    res = A1111Webservice(svc.url).upscale(src, 200, 150)
    assert res["images"][0].size == (200, 150)


def test_extras_keep_the_pictures_infotext(svc):
    meta = PngInfo()
    meta.add_text("parameters", "a cat\nSteps: 20, Seed: 5")
    buf = io.BytesIO()
    picture(64, 64).save(buf, "PNG", pnginfo=meta)
    out = decoded(post(svc, "/sdapi/v1/extra-single-image", {"image": base64.b64encode(buf.getvalue()).decode(),
                                                             "upscaler_1": "Nearest"}).json()["image"])
    assert out.info["parameters"] == "a cat\nSteps: 20, Seed: 5" and "Nearest" in out.info["postprocessing"]


def test_text_pillow_will_not_read_is_a_400_in_png_info_and_the_extras_alike(svc):
    """70 chunks of 1 MB of compressed text before the pixels (a 70 kB file): over what Pillow
    reads (64 MB). The header is probed without them, so the extras met them only when they
    kept the picture's infotext, after the cost was taken: a ValueError there was a 500."""
    from tests.images import text_bomb_png
    bomb = base64.b64encode(text_bomb_png(70, 1_000_000, after_pixels=False)).decode()
    assert_webui_error(post(svc, "/sdapi/v1/png-info", {"image": bomb}), 400, "corrupt_image", "metadata")
    r = post(svc, "/sdapi/v1/extra-single-image", {"image": bomb, "upscaler_1": "Nearest"})
    assert_webui_error(r, 400, "corrupt_image", "image: cannot read its metadata")
    fine = base64.b64encode(text_bomb_png(3, 1_000, after_pixels=False)).decode()  # within it: kept as before
    assert decoded(post(svc, "/sdapi/v1/extra-single-image", {"image": fine, "upscaler_1": "Nearest"})
                   .json()["image"]).info["parameters"] == "a" * 1_000


def test_extras_batch_images(svc):
    images = [picture(64, 48), picture(40, 40)]
    r = api(svc).extra_batch_images(images, upscaler_1="Lanczos", upscaling_resize=1.5)
    assert [img.size for img in r.images] == [(96, 72), (56, 56)]
    for out, src in zip(r.images, images, strict=True):
        assert np.array_equal(pixels(out), pixels(reference_upscale(src, 1.5, Image.LANCZOS)))
    assert r.info == "<p>Postprocess upscale by: 1.5, Postprocess upscaler: Lanczos</p>"
    assert_webui_error(post(svc, "/sdapi/v1/extra-batch-images", {"imageList": []}), 422, "invalid_parameter",
                       "imageList")


def test_extras_limits_are_known_before_any_picture_is_decoded(svc):
    src = b64(picture(64, 64))
    served = httpx.get(svc.url + "/stats").json()["served"]
    r = post(svc, "/sdapi/v1/extra-single-image", {"image": src, "upscaler_1": "Lanczos", "upscaling_resize": 40})
    assert_webui_error(r, 413, "too_many_pixels", "4000000")
    r = post(svc, "/sdapi/v1/extra-batch-images", {"upscaler_1": "Lanczos", "upscaling_resize": 20,
                                                   "imageList": [{"data": src, "name": str(i)} for i in range(3)]})
    assert_webui_error(r, 413, "too_many_pixels", "imageList.2")  # each fits; together they do not
    r = post(svc, "/sdapi/v1/extra-batch-images", {"imageList": [{"data": "garbage#", "name": "x"}] * 17})
    assert_webui_error(r, 422, "invalid_parameter", "17 pictures", "max_images")  # before reading one
    assert_webui_error(post(svc, "/sdapi/v1/extra-single-image", {"image": src, "upscaler_1": "R-ESRGAN 4x+"}),
                       422, "invalid_parameter", "upscaler_1", "R-ESRGAN 4x+")
    assert_webui_error(post(svc, "/sdapi/v1/extra-single-image", {"image": src, "gfpgan_visibility": 0.5}),
                       422, "invalid_parameter", "gfpgan_visibility")
    assert_webui_error(post(svc, "/sdapi/v1/extra-single-image", {"image": b64(picture(4, 4)),
                                                                  "upscaler_1": "Lanczos", "upscaling_resize": 1}),
                       422, "invalid_parameter", "under 8 px")
    try:
        post(svc, "/sdapi/v1/options", {"samples_format": "webp"})
        wide = b64(Image.new("RGB", (8500, 32)))
        r = post(svc, "/sdapi/v1/extra-single-image", {"image": wide, "upscaler_1": "Nearest", "upscaling_resize": 2})
        assert_webui_error(r, 422, "output_too_large", "17000x64", "16383")
        r = post(svc, "/sdapi/v1/extra-single-image", {"image": src, "upscaler_1": "Nearest"})
        assert decoded(r.json()["image"]).format == "WEBP"
    finally:
        post(svc, "/sdapi/v1/options", {"samples_format": "png"})
    assert httpx.get(svc.url + "/stats").json()["served"] == served + 1
    # a header that reads well over pixels that do not: found when the pixels are decoded, still a 400
    good = base64.b64decode(src)
    idat = good.index(b"IDAT")
    broken = good[:idat + 40]  # cut inside its pixel data
    assert_webui_error(post(svc, "/sdapi/v1/extra-single-image", {"image": base64.b64encode(broken).decode(),
                                                                  "upscaler_1": "Lanczos"}), 400, "corrupt_image")
    # a dry run reads the headers and the limits, then stops
    r = post(svc, "/sdapi/v1/extra-single-image", {"image": src, "upscaler_1": "Lanczos"},
             headers={"X-Onecard-Dry-Run": "1"})
    assert r.json()["valid"] is True and r.json()["items"] == 1 and r.json()["cost"]["input_pixels"] > 0

"""Bad-input suite: a corpus of malformed requests against both real services. Each input
gets its exact status and error code in the JSON envelope, the service stays ready, and
a good request right after works."""

from __future__ import annotations

import base64
import io
import json
import socket

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.images import encode, nested_json, pixel_bomb_png, scan_bomb_jpeg, small_png
from tests.service_harness import ServiceProcess

LIMITS = {"max_body_bytes": 2_000_000, "max_pixels": 4_000_000}
PNG = small_png()
JPEG = encode(np.full((40, 40, 3), 90, dtype=np.uint8), "JPEG")
WEBP = encode(np.full((40, 40, 3), 90, dtype=np.uint8), "WEBP")


def _gif() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "GIF")
    return buf.getvalue()


def _tiff() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    return buf.getvalue()


def raw(body: bytes, ctype: str | None = "image/png", query: str = ""):
    return {"content": body, "headers": {"content-type": ctype} if ctype else {}, "query": query}


def js(doc, query: str = ""):
    return {"content": json.dumps(doc, allow_nan=True).encode(), "headers": {"content-type": "application/json"},
            "query": query}


def jsbytes(body: bytes):
    return {"content": body, "headers": {"content-type": "application/json"}, "query": ""}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def multipart(body: bytes, boundary: str = "b"):
    return {"content": body, "headers": {"content-type": f"multipart/form-data; boundary={boundary}"}, "query": ""}


# (name, request, status, code) -- the same corpus goes to both services' image routes
CORPUS = [
    ("zero bytes", raw(b""), 400, "empty_image"),
    ("truncated png", raw(PNG[: len(PNG) // 2]), 400, "corrupt_image"),
    ("png header only", raw(PNG[:33]), 400, "corrupt_image"),
    ("png with corrupt data", raw(PNG[:40] + b"\xff" * 200 + PNG[240:]), 400, "corrupt_image"),
    ("truncated jpeg", raw(JPEG[: len(JPEG) // 2], "image/jpeg"), 400, "corrupt_image"),
    ("jpeg soi only", raw(b"\xff\xd8\xff", "image/jpeg"), 400, "corrupt_image"),
    ("jpeg with garbage", raw(JPEG[:20] + b"\x00" * 300, "image/jpeg"), 400, "corrupt_image"),
    ("truncated webp", raw(WEBP[: len(WEBP) // 2], "image/webp"), 400, "corrupt_image"),
    ("webp riff header only", raw(b"RIFF\x10\x00\x00\x00WEBPVP8 ", "image/webp"), 400, "corrupt_image"),
    ("text posing as png", raw(b"this is not an image at all"), 415, "unsupported_image"),
    ("html posing as jpeg", raw(b"<html><body>hi</body></html>", "image/jpeg"), 415, "unsupported_image"),
    ("gif (not accepted)", raw(_gif(), "image/gif"), 415, "unsupported_image"),
    ("tiff (not accepted)", raw(_tiff(), "image/tiff"), 415, "unsupported_image"),
    ("pixel bomb png", raw(pixel_bomb_png()), 413, "too_many_pixels"),
    ("pixel bomb png 65535x65535", raw(pixel_bomb_png(65535, 65535)), 413, "too_many_pixels"),
    ("jpeg scan bomb", raw(scan_bomb_jpeg(), "image/jpeg"), 413, "image_too_complex"),
    ("oversized body", raw(b"\x89PNG" + b"\0" * 2_100_000), 413, "body_too_large"),
    ("text/plain body", raw(PNG, "text/plain"), 415, "unsupported_media_type"),
    ("no content type", raw(PNG, None), 415, "unsupported_media_type"),
    ("octet-stream", raw(PNG, "application/octet-stream"), 415, "unsupported_media_type"),
    ("application/xml", raw(b"<a/>", "application/xml"), 415, "unsupported_media_type"),
    ("invalid json", raw(b'{"image": ', "application/json"), 400, "bad_json"),
    ("json nested 1000 deep", jsbytes(nested_json(1000)), 400, "json_too_deep"),
    ("json nested 40 deep", jsbytes(nested_json(40)), 400, "json_too_deep"),
    ("json array", js([1, 2, 3]), 422, "invalid_parameter"),
    ("json string", js("image"), 422, "invalid_parameter"),
    ("json null", js(None), 422, "invalid_parameter"),
    ("json without image", js({"picture": b64(PNG)}), 422, "invalid_parameter"),
    ("json image is a number", js({"image": 12345}), 422, "invalid_parameter"),
    ("json image is a bool", js({"image": True}), 422, "invalid_parameter"),
    ("json image is a list", js({"image": [b64(PNG)]}), 422, "invalid_parameter"),
    ("json image not base64", js({"image": "@@@not base64@@@"}), 400, "bad_base64"),
    ("json image base64 of text", js({"image": b64(b"hello world, not an image")}), 415, "unsupported_image"),
    ("json image base64 of a pixel bomb", js({"image": b64(pixel_bomb_png())}), 413, "too_many_pixels"),
    ("json oversized base64", js({"image": "A" * 2_100_000}), 413, "body_too_large"),
    ("json image empty", js({"image": ""}), 400, "empty_image"),
    ("json unicode junk", js({"image": "\u202e\ufeff\U0001f600" * 50}), 400, "bad_base64"),
    ("json invalid utf-8", raw(b'{"image": "\xff\xfe"}', "application/json"), 400, "bad_json"),
    ("json NaN literal", jsbytes(b'{"image": NaN}'), 422, "invalid_parameter"),
    ("json Infinity literal", jsbytes(b'{"image": "x", "a": Infinity}'), 422, "invalid_parameter"),
    ("json 1e999", jsbytes(b'{"image": "x", "a": 1e999}'), 422, "invalid_parameter"),
    ("json integer of 5000 digits", jsbytes(b'{"image": "x", "a": ' + b"9" * 5000 + b"}"), 422, "invalid_parameter"),
    ("json too many fields", js({f"f{i}": 1 for i in range(100)} | {"image": b64(PNG)}), 422, "invalid_parameter"),
    ("multipart without boundary", raw(b"--x\r\n", "multipart/form-data"), 400, "bad_multipart"),
    ("multipart broken", multipart(b"--b\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\nabc"),
     400, "bad_multipart"),
    ("multipart cut inside its picture", multipart(
        b"--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
        b"Content-Type: image/png\r\n\r\n" + PNG[:len(PNG) // 2]), 400, "bad_multipart"),
    ("multipart wrong field", {"files": {"picture": ("a.png", PNG, "image/png")}, "query": ""},
     422, "invalid_parameter"),
    ("url-encoded form (cannot carry an image)", {"data": {"image": "not a file"}, "query": ""},
     415, "unsupported_media_type"),
    ("multipart image as text field", multipart(
        b"--b\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\nnot a file\r\n--b--\r\n"),
     422, "invalid_parameter"),
    ("multipart corrupt image", {"files": {"image": ("a.png", PNG[:50], "image/png")}, "query": ""},
     400, "corrupt_image"),
    ("multipart repeated field", multipart(
        b"--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n\r\n" + PNG +
        b"\r\n--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"b\"\r\n\r\n" + PNG +
        b"\r\n--b--\r\n"), 422, "invalid_parameter"),
    ("query parameter given twice", raw(PNG, query="?a=1&a=2"), 422, "invalid_parameter"),
]
# per-service parameter abuse, each on a good image: all 422 invalid_parameter
DETECT_PARAMS = ["?min_score=NaN", "?min_score=-1", "?min_score=1e309", "?min_score=abc", "?max_faces=0",
                 "?max_faces=-5", "?max_faces=1.5", "?max_faces=99999999999999999999", "?unknown=1",
                 "?min_score=inf", "?min_score=true"]
DETECT_JSON = [{"min_score": True}, {"min_score": "0.5"}, {"max_faces": 2.5}, {"max_faces": False},
               {"min_score": 1e308}, {"max_faces": [1]}]
IMG2IMG_PARAMS = ["?strength=NaN", "?strength=-0.5", "?strength=1.0001", "?steps=-1", "?steps=abc",
                  "?guidance_scale=inf", "?seed=-2", "?seed=99999999999", "?format=bmp", "?style=26",
                  "?style=1:-1", "?style=abc", "?style=3:nan", "?style=3:inf", "?style=3:1e308",
                  "?prompt=" + "x" * 3000, "?response_format=xml", "?extra=1", "?quality=0"]
IMG2IMG_JSON = [{"strength": True}, {"steps": True}, {"steps": "20"}, {"seed": 1.5}, {"style": True},
                {"guidance_scale": None}, {"style": [3]}, {"prompt": 5}]


def send(svc, path: str, req: dict) -> httpx.Response:
    url = svc.url + path + req.get("query", "")
    kwargs = {k: req[k] for k in ("content", "headers", "files", "data") if k in req}
    return httpx.post(url, timeout=60, **kwargs)


def error_of(r: httpx.Response) -> tuple[int, str]:
    try:
        err = r.json()["error"]
    except Exception:  # noqa: BLE001
        return r.status_code, f"not a JSON error: {r.text[:200]}"
    assert isinstance(err["message"], str) and err["message"]
    return r.status_code, err["code"]


def check_corpus(svc, path: str, cases: list[tuple[str, dict, int, str]], good: dict) -> list[str]:
    failures = []
    assert len(cases) >= 50
    for name, req, status, code in cases:
        got = error_of(send(svc, path, req))
        if got != (status, code):
            failures.append(f"{name}: expected {status} {code}, got {got}")
        if httpx.get(svc.url + "/readyz").status_code != 200:
            failures.append(f"{name}: service no longer ready")
        ok = send(svc, path, good)
        if ok.status_code != 200:
            failures.append(f"{name}: the good request after it failed: {ok.status_code}")
    return failures


def _param_cases(queries: list[str], docs: list[dict]) -> list:
    out = [(f"param {q[:40]}", raw(PNG, query=q), 422, "invalid_parameter") for q in queries]
    out += [(f"json {d}", js({"image": b64(PNG), **d}), 422, "invalid_parameter") for d in docs]
    return out


def test_detect_rejects_the_corpus_and_stays_up(tmp_path):
    with ServiceProcess("services.detect.app:create_app", {"max_side": 128, **LIMITS}, tmp_path) as svc:
        cases = CORPUS + _param_cases(DETECT_PARAMS, DETECT_JSON)
        assert check_corpus(svc, "/api/v1/facedetect", cases, raw(PNG)) == []


def test_img2img_rejects_the_corpus_and_stays_up(tmp_path):
    with ServiceProcess("services.img2img.app:create_app", {"max_side": 128, **LIMITS}, tmp_path) as svc:
        cases = CORPUS + _param_cases(IMG2IMG_PARAMS, IMG2IMG_JSON)
        assert check_corpus(svc, "/api/v1/img2img", cases, raw(PNG)) == []


WEBUI_BAD = [
    ({}, 422, "invalid_parameter"),
    ({"init_images": []}, 422, "invalid_parameter"),
    ({"init_images": "x"}, 422, "invalid_parameter"),
    ({"init_images": [123]}, 422, "invalid_parameter"),
    ({"init_images": ["@@@"]}, 400, "bad_base64"),
    ({"init_images": [b64(b"text")]}, 415, "unsupported_image"),
    ({"init_images": [b64(PNG)], "denoising_strength": 2}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "denoising_strength": True}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "steps": 0}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "steps": True}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "cfg_scale": "high"}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "seed": "abc"}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "width": 100000, "height": 100000}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "width": 4000, "height": 4000}, 413, "too_many_pixels"),
    ({"init_images": [b64(PNG)], "batch_size": 10, "n_iter": 10}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "mask": "@@@"}, 400, "bad_base64"),
    ({"init_images": [b64(PNG)], "resize_mode": 7}, 422, "invalid_parameter"),
    ({"init_images": [b64(PNG)], "prompt": "x" * 3000}, 422, "invalid_parameter"),
]


def test_webui_endpoint_rejects_bad_bodies_in_the_webui_error_shape(tmp_path):
    with ServiceProcess("services.img2img.app:create_app", {"max_side": 128, **LIMITS}, tmp_path) as svc:
        failures = []
        for body, status, code in WEBUI_BAD:
            r = httpx.post(svc.url + "/sdapi/v1/img2img", json=body, timeout=60)
            doc = r.json()
            if (r.status_code, doc.get("error")) != (status, code) or not doc.get("detail"):
                failures.append((str(body)[:80], r.status_code, r.text[:200]))
        assert failures == []
        r = httpx.post(svc.url + "/sdapi/v1/img2img", content=b'{"init_images": [NaN]}',
                       headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]) == (422, "invalid_parameter")
        r = httpx.post(svc.url + "/sdapi/v1/img2img", content=b"[1,", headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]) == (400, "bad_json")
        ok = httpx.post(svc.url + "/sdapi/v1/img2img", json={"init_images": [b64(PNG)]}, timeout=60)
        assert ok.status_code == 200


def _raw_exchange(port: int, data: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < 2:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.fixture(scope="module")
def detect(tmp_path_factory):
    with ServiceProcess("services.detect.app:create_app", {"max_side": 128, **LIMITS},
                        tmp_path_factory.mktemp("detect")) as svc:
        yield svc


def test_malformed_http_gets_a_json_400(detect):
    status, doc = _raw_exchange(detect.port, b"POST /api/v1/facedetect HTTP/1.1\r\nHost: x\r\n"
                                             b"Content-Type: image/png\r\nContent-Length: abc\r\n\r\n" + PNG)
    assert (status, doc["error"]["code"]) == (400, "bad_request")
    status, doc = _raw_exchange(detect.port, b"\x00\x01garbage\r\n\r\n")
    assert (status, doc["error"]["code"]) == (400, "bad_request")


def test_oversized_headers_get_431(detect):
    big = b"X-Junk: " + b"a" * 20_000 + b"\r\n"
    status, doc = _raw_exchange(detect.port, b"GET /info HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    assert (status, doc["error"]["code"]) == (431, "headers_too_large")
    many = b"".join(b"X-%d: v\r\n" % i for i in range(3000))
    status, doc = _raw_exchange(detect.port, b"GET /info HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert status == 431
    long_url = b"GET /info?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    status, _ = _raw_exchange(detect.port, long_url)
    assert status == 431
    assert httpx.get(detect.url + "/readyz").status_code == 200


def test_chunked_body_over_the_limit_is_413(detect):
    def chunks():
        for _ in range(40):
            yield b"\0" * 100_000  # 4 MB in all, never declared

    r = httpx.post(detect.url + "/api/v1/facedetect", content=chunks(), headers={"content-type": "image/png"},
                   timeout=30)
    assert error_of(r) == (413, "body_too_large")
    assert httpx.post(detect.url + "/api/v1/facedetect", content=PNG,
                      headers={"content-type": "image/png"}).status_code == 200

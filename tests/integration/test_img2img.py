"""The img2img service: the embedded style backend, a tiny Stable Diffusion pipeline
loaded through the real config path, and the webui-compatible API."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import socket
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.images import astronaut, encode
from tests.models import shared_tiny_sd
from tests.service_harness import ServiceProcess

APP = "services.img2img.app:create_app"


def post(svc, params="", body=None, ctype="image/png", **kw):
    return httpx.post(f"{svc.url}/api/v1/img2img{params}", content=body if body is not None else encode(astronaut()),
                      headers={"content-type": ctype, **kw.pop("headers", {})}, timeout=120, **kw)


def as_array(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.float32)


@pytest.fixture(scope="module")
def style(tmp_path_factory):
    with ServiceProcess(APP, {"backend": "style", "max_side": 512, "device": "cpu"},
                        tmp_path_factory.mktemp("style")) as svc:
        yield svc


def test_style_returns_an_image_of_the_input_size(style):
    r = post(style, "?style=3")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    out = as_array(r.content)
    assert out.shape == (512, 512, 3)
    assert np.abs(out - astronaut()).mean() > 10  # it did change the picture
    assert {"decode", "queue", "infer", "encode"} <= {p.split(";")[0] for p in r.headers["server-timing"].split(", ")}


def test_strength_blends_with_the_input(style):
    full = as_array(post(style, "?style=3&strength=1").content)
    light = as_array(post(style, "?style=3&strength=0.2").content)
    src = astronaut().astype(np.float32)
    assert np.abs(light - src).mean() < 0.5 * np.abs(full - src).mean()


def test_output_formats_and_json_response(style):
    for fmt, mime in (("jpeg", "image/jpeg"), ("webp", "image/webp")):
        r = post(style, f"?format={fmt}")
        assert r.headers["content-type"] == mime and Image.open(io.BytesIO(r.content)).format == fmt.upper()
    refused = post(style, "?seed=7", headers={"accept": "application/json;q=0, image/webp"})  # JSON refused
    assert refused.headers["content-type"] == "image/webp", refused.headers
    r = post(style, "?seed=7", headers={"accept": "application/json, text/plain, */*"})  # axios's default
    doc = r.json()
    assert doc["seed"] == 7 and (doc["width"], doc["height"]) == (512, 512)
    assert Image.open(io.BytesIO(base64.b64decode(doc["image"]))).size == (512, 512)
    body = {"image": base64.b64encode(encode(astronaut())).decode(), "style": "3:0.5,12:0.5",
            "response_format": "json"}
    assert httpx.post(style.url + "/api/v1/img2img", json=body, timeout=60).json()["width"] == 512


def test_arbitrary_style_from_a_style_image(style):
    from tests.images import coffee
    files = {"image": ("a.png", encode(astronaut()), "image/png"),
             "style_image": ("s.png", encode(coffee()), "image/png")}
    r = httpx.post(style.url + "/api/v1/img2img", files=files, timeout=60)
    assert r.status_code == 200
    preset = as_array(post(style, "?style=0").content)
    assert np.abs(as_array(r.content) - preset).mean() > 5


def test_strength_zero_keeps_the_picture(style):
    out = as_array(post(style, "?style=3&strength=0").content)
    assert np.abs(out - astronaut().astype(np.float32)).mean() < 1.0


@pytest.mark.parametrize("query,field", [
    ("?strength=-0.1", "strength"), ("?strength=1.5", "strength"), ("?steps=0", "steps"),
    ("?guidance_scale=nan", "guidance_scale"), ("?seed=abc", "seed"), ("?format=gif", "format"),
    ("?style=99", "style"), ("?bogus=1", "bogus"), ("?steps=900", "steps"),
    ("?style=3:nan", "style"), ("?style=3:inf", "style"), ("?style=3:1e308", "style"),
    ("?guidance_scale=inf", "guidance_scale"), ("?seed=1.5", "seed"),
])
def test_bad_parameters_are_422_naming_the_field(style, query, field):
    r = post(style, query)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(field)


def test_webui_api_and_progress(style):
    body = {"init_images": [base64.b64encode(encode(astronaut())).decode()], "prompt": "oil painting",
            "denoising_strength": 0.6, "steps": 10, "cfg_scale": 5, "seed": 42, "width": 320, "height": 240,
            "sampler_name": "Euler a", "restore_faces": False, "override_settings": {}}
    r = httpx.post(style.url + "/sdapi/v1/img2img", json=body, timeout=60)
    assert r.status_code == 200
    doc = r.json()
    assert set(doc) == {"images", "parameters", "info"}
    assert Image.open(io.BytesIO(base64.b64decode(doc["images"][0]))).size == (320, 240)
    info = json.loads(doc["info"])
    assert info["seed"] == 42 and info["ignored_fields"] == ["restore_faces"]
    assert doc["parameters"]["denoising_strength"] == 0.6
    bad = httpx.post(style.url + "/sdapi/v1/img2img", json={**body, "denoising_strength": 3}, timeout=60)
    assert bad.status_code == 422 and bad.json()["error"] == "invalid_parameter"
    assert "denoising_strength" in bad.json()["detail"]
    prog = httpx.get(style.url + "/sdapi/v1/progress").json()
    assert prog["progress"] == 0.0 and prog["state"]["job_count"] == 0


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    return shared_tiny_sd(tmp_path_factory)


@pytest.fixture(scope="module")
def diffusers_svc(sd_dir, tmp_path_factory):
    settings = {"backend": "diffusers", "model_path": str(sd_dir), "max_side": 64, "max_steps": 1000,
                "request_timeout_s": 60, "scheduler": "ddim", "device": "cpu"}  # the CPU path, whatever the host
    with ServiceProcess(APP, settings, tmp_path_factory.mktemp("sdsvc"), threads=1) as svc:
        yield svc


def small_input() -> bytes:
    return encode(np.asarray(Image.fromarray(astronaut()).resize((64, 64))))


def test_diffusers_is_deterministic_by_seed(diffusers_svc):
    a = post(diffusers_svc, "?seed=1&steps=4&strength=0.8&prompt=a+cat", body=small_input())
    b = post(diffusers_svc, "?seed=1&steps=4&strength=0.8&prompt=a+cat", body=small_input())
    c = post(diffusers_svc, "?seed=2&steps=4&strength=0.8&prompt=a+cat", body=small_input())
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.content == b.content
    assert a.content != c.content
    info = httpx.get(diffusers_svc.url + "/info").json()
    assert info["backend"] == "diffusers" and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["scheduler"] == "DDIMScheduler"


def test_diffusers_webui_sampler_applies_to_its_own_request_only(diffusers_svc):
    before = post(diffusers_svc, "?seed=1&steps=4&strength=0.8", body=small_input())
    body = {"init_images": [base64.b64encode(small_input()).decode()], "steps": 3, "seed": 5,
            "sampler_name": "Euler a"}
    r = httpx.post(diffusers_svc.url + "/sdapi/v1/img2img", json=body, timeout=60)
    assert r.status_code == 200 and json.loads(r.json()["info"])["sampler_name"] == "Euler a"
    after = post(diffusers_svc, "?seed=1&steps=4&strength=0.8", body=small_input())
    assert after.content == before.content  # back on the configured scheduler
    assert httpx.get(diffusers_svc.url + "/info").json()["scheduler"] == "DDIMScheduler"


def _progress(svc):
    return httpx.get(svc.url + "/sdapi/v1/progress", timeout=5).json()


def test_running_generation_stops_when_its_client_disconnects(diffusers_svc):
    body = small_input()
    s = socket.create_connection(("127.0.0.1", diffusers_svc.port))
    s.sendall(b"POST /api/v1/img2img?steps=900&strength=1&seed=3 HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: image/png\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30
    while _progress(diffusers_svc)["state"]["sampling_step"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    s.close()
    t0 = time.monotonic()
    while _progress(diffusers_svc)["state"]["job_count"]:
        assert time.monotonic() - t0 < 5, "still generating after the client left"
        time.sleep(0.05)
    prog_steps = _progress(diffusers_svc)
    assert prog_steps["state"]["job_count"] == 0
    assert post(diffusers_svc, "?steps=2&seed=1", body=small_input()).status_code == 200


def test_running_generation_stops_at_its_deadline(sd_dir, tmp_path):
    settings = {"backend": "diffusers", "model_path": str(sd_dir), "max_side": 64, "max_steps": 1000,
                "request_timeout_s": 1.5, "device": "cpu"}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        t0 = time.monotonic()
        r = post(svc, "?steps=900&strength=1", body=small_input())
        took = time.monotonic() - t0
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert took < 10
        # the 504 goes out at the deadline; the model's thread stops at its next step, a moment
        # later on a loaded machine (each step of 900 would take as long again)
        stop_by = time.monotonic() + 2
        while _progress(svc)["state"]["job_count"]:
            assert time.monotonic() < stop_by, "still generating after its deadline"
            time.sleep(0.05)


# ---- batching ---------------------------------------------------------------------------
def _batch_sizes(svc) -> dict[str, float]:
    """onecard_batch_size histogram counts by bucket (cumulative)."""
    out = {}
    for line in httpx.get(svc.url + "/metrics").text.splitlines():
        if line.startswith("onecard_batch_size_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def _stats(svc) -> dict:
    return httpx.get(svc.url + "/stats", timeout=5).json()


def _wait(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.03)
    raise AssertionError(f"{what} not reached within {timeout} s")


def _hold(svc, body: bytes) -> socket.socket:
    """A long generation on the model, ended by closing the socket."""
    s = socket.create_connection(("127.0.0.1", svc.port))
    s.sendall(b"POST /api/v1/img2img?steps=900&strength=1&seed=9 HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: image/png\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    _wait(lambda: _progress(svc)["state"]["sampling_step"] >= 1, what="the holder generating")
    return s


def test_diffusers_batches_compatible_requests_and_each_matches_its_solo_result(diffusers_svc):
    svc = diffusers_svc
    queries = ["?seed=11&steps=4&strength=0.8&prompt=a+cat", "?seed=12&steps=4&strength=0.8&prompt=a+dog",
               "?seed=13&steps=4&strength=0.8&prompt=a+cat&negative_prompt=blurry"]
    solo = [post(svc, q, body=small_input()).content for q in queries]
    before = _batch_sizes(svc)
    holder = _hold(svc, small_input())
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = []
        for q in queries:
            futs.append(pool.submit(post, svc, q, body=small_input()))
            n = len(futs)
            _wait(lambda n=n: _stats(svc)["items_pending"] == n, what="queued")
        holder.close()  # the holder's generation stops; the three queued go as one batch
        batched = [f.result() for f in futs]
    assert all(r.status_code == 200 for r in batched)
    after = _batch_sizes(svc)
    assert after["3.0"] - after["2.0"] - (before["3.0"] - before["2.0"]) == 1  # one call of three
    for alone, together in zip(solo, batched, strict=True):
        diff = np.abs(as_array(alone) - as_array(together.content)).max()
        assert diff <= 2, diff  # same seed, same picture, batched or alone


def test_a_client_leaving_its_batch_does_not_cancel_the_others(diffusers_svc):
    svc = diffusers_svc
    keep_q = "?seed=21&steps=40&strength=1&prompt=stay"
    alone = post(svc, keep_q, body=small_input()).content
    holder = _hold(svc, small_input())
    body = small_input()
    leaver = socket.create_connection(("127.0.0.1", svc.port))
    leaver.sendall(b"POST /api/v1/img2img?seed=22&steps=40&strength=1&prompt=go HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: image/png\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    _wait(lambda: _stats(svc)["items_pending"] == 1, what="leaver queued")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stayer = pool.submit(post, svc, keep_q, body=small_input())
        _wait(lambda: _stats(svc)["items_pending"] == 2, what="stayer queued")
        holder.close()
        _wait(lambda: _stats(svc)["items_running"] == 2 and _progress(svc)["state"]["sampling_step"] >= 2,
              what="the batch of two generating")
        leaver.close()
        r = stayer.result()
    assert r.status_code == 200
    assert np.abs(as_array(alone) - as_array(r.content)).max() <= 2  # it ran to the end, unchanged


def test_every_client_leaving_stops_the_batch_between_steps(diffusers_svc):
    svc = diffusers_svc
    holder = _hold(svc, small_input())
    body = small_input()
    socks = []
    for seed in (31, 32):
        s = socket.create_connection(("127.0.0.1", svc.port))
        s.sendall(f"POST /api/v1/img2img?seed={seed}&steps=900&strength=1 HTTP/1.1\r\nHost: x\r\n".encode()
                  + b"Content-Type: image/png\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(s)
        _wait(lambda n=len(socks): _stats(svc)["items_pending"] == n, what="queued")
    holder.close()
    _wait(lambda: _stats(svc)["items_running"] == 2 and _progress(svc)["state"]["sampling_step"] >= 2,
          what="the batch of two generating")
    for s in socks:
        s.close()
    _wait(lambda: _progress(svc)["state"]["job_count"] == 0, timeout=5, what="the batch stopped")
    assert post(svc, "?steps=2&seed=1", body=small_input()).status_code == 200


def test_style_batches_requests_of_the_same_style_and_size(tmp_path):
    settings = {"backend": "style", "max_side": 256, "max_batch_size": 4, "batch_policy": "fixed", "max_wait_ms": 300}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        src = encode(np.asarray(Image.fromarray(astronaut()).resize((256, 256))))
        solo = as_array(post(svc, "?style=5", body=src).content)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda _: post(svc, "?style=5", body=src), range(4)))
        assert all(r.status_code == 200 for r in rs)
        sizes = _batch_sizes(svc)
        assert sizes["4.0"] - sizes["3.0"] >= 1  # one call of four
        for r in rs:
            assert np.abs(as_array(r.content) - solo).max() <= 1
        mixed = [lambda: post(svc, "?style=5", body=src), lambda: post(svc, "?style=6", body=src)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a, b = [f.result() for f in [pool.submit(m) for m in mixed]]
        assert np.abs(as_array(a.content) - as_array(b.content)).mean() > 5  # each kept its own style


def test_incompatible_requests_run_in_separate_calls(diffusers_svc):
    svc = diffusers_svc
    queries = ["?seed=41&steps=4&strength=0.8", "?seed=41&steps=6&strength=0.8",
               "?seed=41&steps=4&strength=0.5", "?seed=41&steps=4&strength=0.8&guidance_scale=2"]
    solo = [post(svc, q, body=small_input()).content for q in queries]
    before = _batch_sizes(svc)
    holder = _hold(svc, small_input())
    with concurrent.futures.ThreadPoolExecutor(len(queries)) as pool:
        futs = []
        for q in queries:
            futs.append(pool.submit(post, svc, q, body=small_input()))
            n = len(futs)
            _wait(lambda n=n: _stats(svc)["items_pending"] == n, what="queued")
        holder.close()
        rs = [f.result() for f in futs]
    after = _batch_sizes(svc)
    assert after["1.0"] - before["1.0"] == len(queries) + 1  # the holder and each alone
    for alone, r in zip(solo, rs, strict=True):
        assert np.abs(as_array(alone) - as_array(r.content)).max() <= 2

"""The attack classes of the bounded-cost issue (items 1 to 10), with the recipes it gives.

Each attack takes the unit (bench/attack_unit.Unit) and a shared dict (what one attack leaves
for another: the big job), sends its requests, and returns what the clients saw:
{"statuses": {"413 too_costly": 2, ...}, "notes": {...}}. The soak measures the rest.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import cv2
import numpy as np

from bench.attack_net import Holder, b64, concurrently, error_code, post_json, request, tally, trickle
from tests import images as I

WEBUI = "/sdapi/v1/img2img"
Result = dict[str, Any]


def _smooth(side: int, seed: int = 0) -> bytes:
    """A JPEG whose picture is noise scaled up: an ordinary photo's size on the wire."""
    small = np.random.default_rng(seed).integers(0, 255, (512, 512, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", cv2.resize(small, (side, side)), [cv2.IMWRITE_JPEG_QUALITY, 80])[1].tobytes()


def _photo_1024() -> bytes:
    from PIL import Image
    return I.encode(np.asarray(Image.fromarray(I.astronaut()).resize((1024, 1024))), "JPEG", quality=90)


# ---- 1. many init_images of a pixel bomb ----------------------------------------------------
def webui_many_init_images(u, ctx) -> Result:
    bomb = b64(I.flat_png(6324, 6324))
    rs = [post_json(u.ports["img2img"], WEBUI, {"init_images": [bomb] * 64, "denoising_strength": 0.5, "steps": 2})]
    rs.append(post_json(u.ports["img2img"], WEBUI, {"init_images": [bomb] * 16, "batch_size": 16,
                                                    "denoising_strength": 0.5, "steps": 2}))
    return {"statuses": tally(rs), "notes": {"png_bytes": len(bomb) * 3 // 4,
                                             "seconds": [round(r["s"], 2) for r in rs],
                                             "requests": ["64 init_images", "16 init_images, batch_size 16"]}}


# ---- 2. batch products ----------------------------------------------------------------------
def webui_batch16(u, ctx) -> Result:
    photo = b64(_photo_1024())
    rs = [post_json(u.ports["img2img"], WEBUI, {"init_images": [photo], "batch_size": 16, "width": 1024,
                                                "height": 1024, "denoising_strength": 0.75, "steps": 2})]
    big = b64(I.flat_png(6320, 6320))
    rs.append(post_json(u.ports["img2img"], WEBUI, {"init_images": [big], "batch_size": 16, "width": 6320,
                                                    "height": 6320, "denoising_strength": 0.75, "steps": 2}))
    return {"statuses": tally(rs), "notes": {"seconds": [round(r["s"], 2) for r in rs],
                                             "requests": ["1024x1024 batch_size 16", "6320x6320 batch_size 16"]}}


def native_17_concurrent(u, ctx) -> Result:
    photo = _photo_1024()
    rs = concurrently(lambda i: request(u.ports["img2img"], "POST", "/api/v1/img2img?style=3", photo,
                                        {"Content-Type": "image/jpeg"}, keep_body=False), 17)
    return {"statuses": tally(rs), "notes": {"max_s": round(max(r["s"] for r in rs), 2)}}


# ---- 3. options store ---------------------------------------------------------------------------
def options_flood(u, ctx) -> Result:
    port = u.ports["img2img"]
    rs = []
    for i in range(30):  # about 1 MB each, new keys every time, each value under the per-key bound
        doc = {f"attack_{i}_{k}": "x" * 60_000 for k in range(16)}
        rs.append(post_json(port, "/sdapi/v1/options", doc))
    rs.append(post_json(port, "/sdapi/v1/options", {"attack_one_big": "x" * 1_000_000}))
    gets = [request(port, "GET", "/sdapi/v1/options") for _ in range(10)]
    return {"statuses": tally(rs + gets),
            "notes": {"get_s_max": round(max(r["s"] for r in gets), 3),
                      "get_bytes": len(gets[-1]["body"]), "post_codes": [r["status"] for r in rs]}}


# ---- 4. polls of a big result never read --------------------------------------------------------
def _big_job(u, ctx) -> str | None:
    if ctx.get("big_job"):
        return ctx["big_job"]
    body = {"service": "img2img", "route": "/api/v1/img2img", "params": {"style": 3, "format": "png"},
            "image": b64(_smooth(4250))}
    r = post_json(u.ports["jobs"], "/v1/jobs", body)
    if r["status"] != 202:
        ctx["big_job_error"] = f"{r['status']} {r['body'][:200]!r}"
        return None
    import json
    job = json.loads(r["body"])["id"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        g = request(u.ports["jobs"], "GET", f"/v1/jobs/{job}?result=false")
        if g["status"] == 200 and json.loads(g["body"])["state"] in ("succeeded", "failed"):
            break
        time.sleep(1)
    res = request(u.ports["jobs"], "GET", f"/v1/jobs/{job}/result", keep_body=False)
    ctx["big_job"], ctx["big_job_result_status"] = job, res["status"]
    return job


def job_polls_unread(u, ctx) -> Result:
    job = _big_job(u, ctx)
    if job is None:
        return {"statuses": {}, "notes": {"skipped": ctx.get("big_job_error")}}
    h = Holder(u.ports["jobs"], f"GET /v1/jobs/{job} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 100).open()
    time.sleep(35)  # past send_timeout_s (30 s): the server must have let them go
    reset = h.reset_by_server()
    h.close()
    size = request(u.ports["jobs"], "GET", f"/v1/jobs/{job}", keep_body=True)
    return {"statuses": {}, "notes": {"connections": 100 - h.failed, "reset_by_server_after_35s": reset,
                                      "poll_answer_bytes": len(size["body"]), "poll_status": size["status"]}}


job_polls_unread.prepare = _big_job  # the job's own run is not part of the attack


# ---- 5. many big submits ------------------------------------------------------------------------
def jobs_big_submits(u, ctx, n: int = 200, size: int = 30_000_000) -> Result:
    junk = b"A" * (size - 100)
    body = b'{"service": "detect", "route": "/api/v1/facedetect", "image": "' + junk + b'"}'
    rs = concurrently(lambda i: request(u.ports["jobs"], "POST", "/v1/jobs", body,
                                        {"Content-Type": "application/json"}, timeout=300), n)
    return {"statuses": tally(rs), "notes": {"body_bytes": len(body), "max_s": round(max(r["s"] for r in rs), 1)}}


# ---- 6. big answers nobody reads ------------------------------------------------------------------
def big_answers_unread(u, ctx) -> Result:
    job = _big_job(u, ctx)
    if job is None:
        return {"statuses": {}, "notes": {"skipped": ctx.get("big_job_error")}}
    h = Holder(u.ports["jobs"], f"GET /v1/jobs/{job}/result HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 20).open()
    time.sleep(35)
    reset = h.reset_by_server()
    h.close()
    return {"statuses": {}, "notes": {"connections": 20 - h.failed, "reset_by_server_after_35s": reset}}


big_answers_unread.prepare = _big_job


# ---- 7. idle holders on the probe port ------------------------------------------------------------
def probe_port_holders(u, ctx) -> Result:
    notes = {}
    for n in (30, 70, 600):
        t_end = time.monotonic() + 14
        opened = 0
        while time.monotonic() < t_end:
            h = Holder(u.health_port, b"", n).open()
            opened += len(h.socks)
            time.sleep(4.5)
            h.close()
        notes[f"{n}_holders_opened"] = opened
    return {"statuses": {}, "notes": notes}


# ---- 8. one request that holds the CPU pool; decoders without a bound ------------------------------
def heavy_then_small(u, ctx) -> Result:
    port = u.ports["img2img"]
    heavy: dict = {}
    t = threading.Thread(target=lambda: heavy.update(post_json(port, WEBUI, {
        "init_images": [b64(I.flat_png(6320, 6320))], "denoising_strength": 0, "width": 6320, "height": 6320,
        "batch_size": 16})))
    t.start()
    time.sleep(3)
    small = post_json(port, WEBUI, {"init_images": [b64(I.small_png())], "width": 64, "height": 64, "steps": 2})
    t.join()
    return {"statuses": tally([heavy, small]),
            "notes": {"heavy_s": round(heavy["s"], 2), "small_s": round(small["s"], 2),
                      "heavy": f"{heavy['status']} {error_code(heavy)}", "small": small["status"]}}


def decoder_bombs(u, ctx) -> Result:
    files = {"rle8_bmp_1x2_20MB": (I.rle8_bmp_bomb(), "image/bmp"), "rle4_bmp_6324": (I.rle4_bmp(), "image/bmp"),
             "png_1.58M_empty_chunks": (I.png_chunk_bomb(), "image/png")}
    rs, notes = [], {}
    for name, (data, ctype) in files.items():
        for svc, path in (("detect", "/api/v1/facedetect"), ("img2img", "/api/v1/img2img?style=3")):
            r = request(u.ports[svc], "POST", path, data, {"Content-Type": ctype}, keep_body=False)
            rs.append(r)
            notes[f"{name} -> {svc}"] = f"{r['status']} {error_code(r) or ''} in {r['s']:.2f} s"
    return {"statuses": tally(rs), "notes": notes}


# ---- 9. big uploads and the GIL -------------------------------------------------------------------
def big_png_uploads(u, ctx) -> Result:
    png = I.noisy_png(4000, 3000, 0.42)
    rs = concurrently(lambda i: request(u.ports["detect"], "POST", "/api/v1/facedetect", png,
                                        {"Content-Type": "image/png"}), 16)
    return {"statuses": tally(rs), "notes": {"png_bytes": len(png), "max_s": round(max(r["s"] for r in rs), 1)}}


def big_png_uploads_as_json(u, ctx) -> Result:
    """The same pictures as base64 in a JSON body (the webui's way): parsing and base64 keep the GIL."""
    import base64
    import json
    body = json.dumps({"image": base64.b64encode(I.noisy_png(4000, 3000, 0.42)).decode()}).encode()
    rs = concurrently(lambda i: request(u.ports["detect"], "POST", "/api/v1/facedetect", body,
                                        {"Content-Type": "application/json"}), 16)
    return {"statuses": tally(rs), "notes": {"json_bytes": len(body), "max_s": round(max(r["s"] for r in rs), 1)}}


def big_png_uploads_as_forms(u, ctx) -> Result:
    """The same pictures in multipart forms (curl -F, requests' files=)."""
    png = I.noisy_png(4000, 3000, 0.42)
    body = (b"--onecardbench\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + png + b"\r\n--onecardbench--\r\n")
    rs = concurrently(lambda i: request(u.ports["detect"], "POST", "/api/v1/facedetect", body,
                                        {"Content-Type": "multipart/form-data; boundary=onecardbench"}), 16)
    return {"statuses": tally(rs), "notes": {"form_bytes": len(body), "max_s": round(max(r["s"] for r in rs), 1)}}


def big_png_img2img(u, ctx) -> Result:
    """The same pictures to img2img's native route: decoded whole (no JPEG-style reduced
    decode for PNG at this size), then scaled to its max_side, then queued for the model."""
    png = I.noisy_png(4000, 3000, 0.42)
    rs = concurrently(lambda i: request(u.ports["img2img"], "POST", "/api/v1/img2img?style=3", png,
                                        {"Content-Type": "image/png"}, keep_body=False, timeout=180), 16)
    return {"statuses": tally(rs), "notes": {"png_bytes": len(png), "max_s": round(max(r["s"] for r in rs), 1)}}


def big_png_webui(u, ctx) -> Result:
    """The same pictures as webui init_images (base64 JSON), as AUTOMATIC1111 clients send them."""
    import json
    body = json.dumps({"init_images": [b64(I.noisy_png(4000, 3000, 0.42))], "denoising_strength": 0.5,
                       "steps": 2}).encode()
    rs = concurrently(lambda i: request(u.ports["img2img"], "POST", WEBUI, body, {"Content-Type": "application/json"},
                                        keep_body=False, timeout=180), 16)
    return {"statuses": tally(rs), "notes": {"max_s": round(max(r["s"] for r in rs), 1)}}


def big_png_jobs(u, ctx) -> Result:
    """The same pictures submitted as jobs (base64 JSON, under the jobs body limit): the jobs
    service parses and stores them, then detect runs them. Each job is polled to its end."""
    import base64
    import json
    body = json.dumps({"service": "detect", "route": "/api/v1/facedetect",
                       "image": base64.b64encode(I.noisy_png(4000, 3000, 0.42)).decode()}).encode()
    rs = concurrently(lambda i: request(u.ports["jobs"], "POST", "/v1/jobs", body,
                                        {"Content-Type": "application/json"}, timeout=120), 16)
    ids = [json.loads(r["body"])["id"] for r in rs if r["status"] == 202]
    states: dict[str, int] = {}
    deadline = time.monotonic() + 180
    for job in ids:
        while time.monotonic() < deadline:
            g = request(u.ports["jobs"], "GET", f"/v1/jobs/{job}?result=false")
            state = json.loads(g["body"]).get("state") if g["status"] == 200 else f"http {g['status']}"
            if state in ("succeeded", "failed", "dead") or g["status"] != 200:
                break
            time.sleep(0.5)
        states[state] = states.get(state, 0) + 1
    return {"statuses": tally(rs), "notes": {"json_bytes": len(body), "job_states": states}}


# ---- 10. an endless header value --------------------------------------------------------------------
def endless_header(u, ctx) -> Result:
    rs, notes = [], {}
    stop = threading.Event()
    for name in ("detect", "img2img", "jobs"):
        r = trickle(u.ports[name], b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ", b"a" * 16384, 0.0, stop,
                    max_bytes=64 << 20)
        rs.append(r)
        notes[name] = f"{r['status']} in {r['s']:.2f} s ({r['sent']} bytes pushed before it was seen)"
    r = trickle(u.health_port, b"GET /healthz HTTP/1.1\r\nX-Long: ", b"a" * 16384, 0.0, stop, max_bytes=64 << 20)
    rs.append(r)
    notes["probe port"] = f"{r['status']} in {r['s']:.2f} s ({r['sent']} bytes pushed before it was seen)"
    return {"statuses": tally(rs), "notes": notes}


ISSUE_ATTACKS = [
    ("1 64 init_images of a 6324px PNG", webui_many_init_images),
    ("2a webui batch_size 16 (1024, 6320)", webui_batch16),
    ("2b 17 concurrent 1024px native", native_17_concurrent),
    ("3 options: 30 x 1 MB new keys", options_flood),
    ("4 100 unread polls of a 27 MB result", job_polls_unread),
    ("5 200 concurrent 30 MB submits", jobs_big_submits),
    ("6 20 unread 27 MB answers", big_answers_unread),
    ("7 idle holders on the probe port", probe_port_holders),
    ("8a heavy webui then 64x64", heavy_then_small),
    ("8b decoder bombs (BMP RLE, PNG chunks)", decoder_bombs),
    ("9 16 concurrent 12 MP PNG uploads", big_png_uploads),
    ("9b the same as base64 JSON", big_png_uploads_as_json),
    ("9c the same as multipart forms", big_png_uploads_as_forms),
    ("9j the same as jobs (base64 JSON)", big_png_jobs),
    ("9i the same to img2img (PNG)", big_png_img2img),
    ("9w the same as webui init_images", big_png_webui),
    ("10 endless header value", endless_header),
]

"""More attacks of the issue's classes, found by a review of the soak (helper-33): framing that
never ends, connection churn on the probe port, big extras answers, ordinary listing
readers, and clients that send a request and leave without its answer. Each is what a
client without credentials can do; run by bench/attack_soak.py."""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import socket
import struct
import threading
import time
import uuid
from typing import Any

from bench.attack_classes import _big_job
from bench.attack_net import HOST, Holder, b64, concurrently, post_json, request, tally, trickle
from common.socket_queues import TCP_CLOSE, TCP_CLOSE_WAIT, tcp_state
from tests import images as I
from tests.webp_bombs import vp8l_bomb

Result = dict[str, Any]


def endless_chunk_framing(u, ctx) -> Result:
    """16 connections to detect: a PNG in one chunk, the last chunk, then a trailer value that
    never ends (16 KiB pieces, 2 MB/s each); then 16 whose chunk-size line is endless zeros."""
    png = I.small_png()
    head = (b"POST /api/v1/facedetect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    trailer = head + f"{len(png):x}\r\n".encode() + png + b"\r\n0\r\nX-T: "
    never = threading.Event()

    def send(first: bytes, piece: bytes) -> dict:  # 2 MB/s for 20 s at most
        return trickle(u.ports["detect"], first, piece, len(piece) / 2e6, never, max_bytes=40 * 10**6)
    got = concurrently(lambda i: send(trailer, b"b" * 16384), 16)
    got += concurrently(lambda i: send(head, b"0" * 16384), 16)
    return {"statuses": tally(got), "notes": {"sent_mib_max": round(max(r["sent"] for r in got) / 2**20, 2),
                                              "s_max": round(max(r["s"] for r in got), 1)}}


def probe_port_churn(u, ctx) -> Result:
    """24 threads connecting to the probe port and closing at once, in a loop, for 25 s: a third
    just close, a third reset, a third send half a request first."""
    counts = {"close": 0, "reset": 0, "half": 0, "error": 0}
    lock = threading.Lock()
    t_end = time.monotonic() + 25

    def client(i: int) -> dict:
        kind = ("close", "reset", "half")[i % 3]
        while time.monotonic() < t_end:
            try:
                s = socket.socket()
                s.settimeout(2)
                s.connect((HOST, u.health_port))
                if kind == "reset":
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif kind == "half":
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                s.close()
                key = kind
            except OSError:
                key = "error"
                time.sleep(0.01)
            with lock:
                counts[key] += 1
        return {}
    concurrently(client, 24)
    return {"statuses": {}, "notes": counts}


def extras_upscales(u, ctx) -> Result:
    """The webui extras, 4 at once each: 4 photos of 1400 px x2, 16 of 300 px x4 with a second
    upscaler, one 300 px x21 (a 40 MP answer), one 65535x1 crop (refused)."""
    import numpy as np
    from PIL import Image
    photo = b64(I.encode(np.asarray(Image.fromarray(I.astronaut()).resize((1400, 1400))), "JPEG", quality=92))
    small = b64(I.encode(np.asarray(Image.fromarray(I.astronaut()).resize((300, 300))), "PNG"))
    cases = {
        "batch 4 x 1400px x2": {"imageList": [{"data": photo, "name": f"{i}.jpg"} for i in range(4)],
                                "upscaler_1": "Lanczos", "upscaling_resize": 2},
        "batch 16 x 300px x4, upscaler_2": {"imageList": [{"data": small, "name": f"{i}.png"} for i in range(16)],
                                            "upscaler_1": "Lanczos", "upscaler_2": "Nearest",
                                            "extras_upscaler_2_visibility": 0.5, "upscaling_resize": 4},
        "single 65535x1 crop": {"image": small, "resize_mode": 1, "upscaling_resize_w": 65535,
                                "upscaling_resize_h": 1, "upscaling_crop": True, "upscaler_1": "Lanczos"},
        "single 300px x21": {"image": small, "upscaler_1": "Lanczos", "upscaling_resize": 21},
    }
    rs, notes = [], {}
    for name, doc in cases.items():
        path = "/sdapi/v1/extra-batch-images" if "imageList" in doc else "/sdapi/v1/extra-single-image"
        got = concurrently(lambda i, doc=doc, path=path: post_json(u.ports["img2img"], path, doc, timeout=180,
                                                                   keep_body=False), 4)
        rs += got
        notes[name] = f"{tally(got)} max {max(r['s'] for r in got):.1f} s"
    return {"statuses": tally(rs), "notes": notes}


def listing_readers(u, ctx) -> Result:
    """6 clients submitting (and cancelling) small jobs for 20 s, each with a new 255-character
    Idempotency-Key; then 16 clients reading 500-job listings of that model, for 25 s."""
    body = json.dumps({"service": "detect", "route": "/api/v1/facedetect", "image": b64(I.small_png())}).encode()
    port = u.ports["jobs"]
    ids: list[str] = []
    lock = threading.Lock()

    def submitter(i: int) -> dict:
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:
            key = (f"{i:02d}-" + uuid.uuid4().hex * 8)[:255]
            r = request(port, "POST", "/v1/jobs", body, {"Content-Type": "application/json", "Idempotency-Key": key},
                        timeout=30)
            if r["status"] == 202:
                job = json.loads(r["body"])["id"]
                with lock:
                    ids.append(job)
                request(port, "DELETE", f"/v1/jobs/{job}", timeout=30)
        return {}
    concurrently(submitter, 6)
    model = "detect"
    if ids:
        try:
            model = json.loads(request(port, "GET", f"/v1/jobs/{ids[-1]}?result=false")["body"])["model"]
        except (ValueError, KeyError):
            pass
    path = f"/v1/jobs?model={model}&limit=500"
    got: list[dict] = []

    def reader(i: int) -> dict:
        t_end = time.monotonic() + 25
        while time.monotonic() < t_end:
            r = request(port, "GET", path, timeout=30, keep_body=False)
            with lock:
                got.append(r)
        return {}
    concurrently(reader, 16)
    return {"statuses": tally(got), "notes": {"jobs": len(ids), "reads": len(got)}}


def send_and_hang_up(u, ctx) -> Result:
    """32 clients on the jobs and detect ports (16 each), 20 s: each connection sends a whole
    request, waits 0-10 ms and leaves without reading its answer, half of them with a reset
    (SO_LINGER 0), half with a close (from helper-35's review: 5 500 connections a second)."""
    import random
    sent = {"reset": 0, "close": 0}
    lock = threading.Lock()
    t_end = time.monotonic() + 20

    def client(i: int) -> dict:
        port, path = (u.ports["jobs"], "/v1/jobs/" + "0" * 32) if i % 2 else (u.ports["detect"], "/nope")
        how = "reset" if i % 4 < 2 else "close"
        while time.monotonic() < t_end:
            try:
                s = socket.create_connection((HOST, port), timeout=10)
                if how == "reset":
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                time.sleep(random.random() * 0.01)
                s.close()
            except OSError:
                continue
            with lock:
                sent[how] += 1
        return {}
    concurrently(client, 32)
    return {"statuses": {}, "notes": sent}


def lossless_webp_groups(u, ctx, padded_to: int = 0) -> Result:
    """8 clients on detect and 8 on img2img's native route, 20 s, each sending a 1024x1024
    lossless WebP of 300 kB whose 65 536 groups of Huffman codes make libwebp build about
    360 MiB of tables a decode (helper-45; its 18 MB kind held 1.25 GB and took the unit down)."""
    data = vp8l_bomb()
    if padded_to:  # a chunk of nothing after the picture: the file as big as the body limit allows
        pad = b"JUNK" + struct.pack("<I", padded_to - len(data) - 8) + bytes(padded_to - len(data) - 8)
        data = b"RIFF" + struct.pack("<I", len(data) - 8 + len(pad)) + data[8:] + pad
    t_end = time.monotonic() + 20
    targets = [(u.ports["detect"], "/api/v1/facedetect"), (u.ports["img2img"], "/api/v1/img2img?style=3&format=jpeg")]

    def client(i: int) -> list[dict]:
        port, path = targets[i % 2]
        got = []
        while time.monotonic() < t_end:
            got.append(request(port, "POST", path, data, {"Content-Type": "image/webp"}, timeout=120,
                               keep_body=False))
        return got
    got = [r for rs in concurrently(client, 16) for r in rs]
    return {"statuses": tally(got), "notes": {"bytes": len(data), "requests": len(got)}}


def big_lossless_webp_resent(u, ctx) -> Result:
    """The same picture padded to 18 MB, resent the moment it is refused: Pillow's WebP probe
    copied each whole file twice holding the GIL (detect's /healthz p99 178-293 ms)."""
    return lossless_webp_groups(u, ctx, padded_to=18 * 10**6)


def detailed_webp_answers(u, ctx) -> Result:
    """6 clients, 20 s, asking img2img for the answer as WebP at quality 100, each sending a
    picture of detail all over (noise at 1024x1024 scaled up to 16 MP, 6.7 MB of JPEG) kept as
    it is (strength 0): libwebp held 17-32 bytes a pixel to write such an answer, where 3 were
    charged, and four at once in the CPU pool were 2 GB no budget knew of. The same at 12 MP
    asked as WebP, then as JPEG, by 2 more clients: what a budget admits is served."""
    import cv2
    import numpy as np
    noise = np.random.default_rng(7).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)

    def jpeg_of(width: int, height: int) -> bytes:
        big = cv2.resize(noise, (width, height), interpolation=cv2.INTER_CUBIC)
        return cv2.imencode(".jpg", big, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
    pictures = {"16mp": jpeg_of(4000, 4000), "12mp": jpeg_of(4000, 3000)}
    t_end = time.monotonic() + 20
    port = u.ports["img2img"]
    asks = [("16mp", "webp")] * 6 + [("12mp", "webp"), ("12mp", "jpeg")]

    def client(i: int) -> list[dict]:
        size, fmt = asks[i]
        got = []
        while time.monotonic() < t_end:
            got.append(request(port, "POST", f"/api/v1/img2img?format={fmt}&quality=100&strength=0",
                               pictures[size], {"Content-Type": "image/jpeg"}, timeout=120, keep_body=False))
        return got
    got = [r for rs in concurrently(client, len(asks)) for r in rs]
    return {"statuses": tally(got), "notes": {"bytes": {k: len(v) for k, v in pictures.items()},
                                              "requests": len(got)}}


def result_readers_unread(u, ctx) -> Result:
    """700 connections asking for a job's 8 MB result and reading none of it, each opened again
    as soon as the server resets it, for 40 s, while 2 clients read the same result whole
    (helper-53: 250 of them held every max_result_streams slot, 700 every place on the port;
    the readers got 503 busy or too_many_connections). The readers' statuses are the verdict."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    job = _big_job(u, ctx)
    if job is None:
        return {"statuses": {}, "notes": {"skipped": ctx.get("big_job_error")}}
    ask = f"GET /v1/jobs/{job}/result HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    port, t_end = u.ports["jobs"], time.monotonic() + 40
    holders = [Holder(port, ask, 100).open() for _ in range(int(os.environ.get("B27_HOLDERS", "7")))]
    reopened = [0]

    def keep_holding(h) -> dict:
        while time.monotonic() < t_end:
            time.sleep(1.0)
            for i, sock in enumerate(h.socks):
                # its state, not a read: reading what the kernel took (as this did) made a slow
                # reader of each holder, and a peek sees the data, not the reset behind it
                if tcp_state(sock) not in (TCP_CLOSE, TCP_CLOSE_WAIT):
                    continue
                sock.close()
                fresh = Holder(port, ask, 1).open()
                if fresh.socks:
                    h.socks[i] = fresh.socks[0]
                    reopened[0] += 1
        return {}

    def reader(i: int) -> list[dict]:
        got = []
        while time.monotonic() < t_end:
            got.append(request(port, "GET", f"/v1/jobs/{job}/result", timeout=60, keep_body=False))
        return got
    with concurrent.futures.ThreadPoolExecutor(len(holders) + 2) as pool:
        holding = [pool.submit(keep_holding, h) for h in holders]
        reads = [pool.submit(reader, i) for i in range(2)]
        got = [r for f in reads for r in f.result()]
        for f in holding:
            f.result()
    for h in holders:
        h.close()
    return {"statuses": tally(got), "notes": {"reads": len(got), "max_read_s": round(max(r["s"] for r in got), 1),
                                              "holders_reopened": reopened[0]}}


result_readers_unread.prepare = _big_job  # the job's own run is not part of the attack


MORE_ATTACKS = [
    ("B19 endless chunk framing (trailer value, size zeros)", endless_chunk_framing),
    ("B20 probe port connect-and-close churn", probe_port_churn),
    ("B21 big extras upscales (RSS back)", extras_upscales),
    ("B22 16 readers of 500-job listings", listing_readers),
    ("B23 requests sent and hung up on (reset, close)", send_and_hang_up),
    ("B24 lossless WebP naming 65 536 Huffman groups", lossless_webp_groups),
    ("B25 18 MB lossless WebP resent after each 413", big_lossless_webp_resent),
    ("B26 detailed 16 MP pictures answered as WebP at quality 100", detailed_webp_answers),
    ("B27 700 unread readers of a job's result, reopened when reset", result_readers_unread),
]

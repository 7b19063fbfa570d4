"""Attack classes of our own, beside the issue's: what someone who wants the unit to die would
try next. Same shape as bench/attack_classes.py: (unit, shared dict) -> {"statuses", "notes"}.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from bench.attack_net import HOST, Holder, b64, concurrently, error_code, post_json, request, tally, trickle
from tests import images as I

Result = dict[str, Any]


def _for(seconds: float, n: int, fn) -> list[dict]:
    """n clients, each sending fn(i) again and again for `seconds`."""
    out: list[dict] = []
    lock = threading.Lock()
    t_end = time.monotonic() + seconds

    def client(i: int) -> dict:
        while time.monotonic() < t_end:
            r = fn(i)
            r.pop("body", None) if r.get("status") == 200 else None
            with lock:
                out.append(r)
        return {}
    concurrently(client, n)
    return out


# ---- JSON that costs more parsed than sent ------------------------------------------------------
def json_tiny_containers(u, ctx) -> Result:
    """18 MB of `[]` (3 bytes each, 56 bytes parsed): json.loads holds the GIL for the whole
    document. 4 clients on detect and 2 on the jobs submit, for 20 s."""
    body = I.tiny_containers_json(18_000_000)
    jobs_body = I.tiny_containers_json(30_000_000)
    hdr = {"Content-Type": "application/json"}
    rs: list[dict] = []
    t = threading.Thread(target=lambda: rs.extend(_for(20, 2, lambda i: request(
        u.ports["jobs"], "POST", "/v1/jobs", jobs_body, hdr, timeout=120))))
    t.start()
    rs += _for(20, 4, lambda i: request(u.ports["detect"], "POST", "/api/v1/facedetect", body, hdr, timeout=120))
    t.join()
    return {"statuses": tally(rs), "notes": {"requests": len(rs), "max_s": round(max(r["s"] for r in rs), 2)}}


def json_odd_numbers(u, ctx) -> Result:
    """Numbers at the edges in every JSON route: 5000-digit integers, 1e308, -0, 1e-400."""
    png = b64(I.small_png())
    rs, notes = [], {}
    for label, raw in (("5000 digits", "9" * 5000), ("1e308", "1e308"), ("-0", "-0"), ("1e-400", "1e-400"),
                       ("1.5", "1.5")):
        cases = [("detect", "/api/v1/facedetect", f'{{"image": "{png}", "max_faces": {raw}}}'),
                 ("img2img", "/api/v1/img2img", f'{{"image": "{png}", "seed": {raw}, "steps": {raw}}}'),
                 ("img2img", "/sdapi/v1/img2img", f'{{"init_images": ["{png}"], "seed": {raw}, "n_iter": {raw}}}'),
                 ("jobs", "/v1/jobs", f'{{"service": "detect", "route": "/api/v1/facedetect", "image": "{png}", '
                                      f'"params": {{"min_score": {raw}}}}}')]
        for svc, path, doc in cases:
            r = request(u.ports[svc], "POST", path, doc.encode(), {"Content-Type": "application/json"})
            rs.append(r)
            notes[f"{label} -> {svc}{path}"] = f"{r['status']} {error_code(r) or ''}"
    return {"statuses": tally(rs), "notes": notes}


# ---- slow clients ---------------------------------------------------------------------------------
def slowloris_headers(u, ctx) -> Result:
    """400 connections to img2img sending one header line a second (a fresh one when cut)."""
    stop = threading.Event()
    rs: list[dict] = []

    def client(i: int) -> dict:
        while not stop.is_set():
            rs.append(trickle(u.ports["img2img"], b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"X-a: b\r\n", 1.0, stop))
        return {}
    t = threading.Thread(target=lambda: concurrently(client, 400))
    t.start()
    time.sleep(25)
    stop.set()
    t.join()
    done = [r for r in rs if r["status"] is not None]
    return {"statuses": tally(done), "notes": {"connections": len(rs),
                                               "cut_without_answer": len(rs) - len(done)}}


def connection_flood(u, ctx) -> Result:
    """700 connections that say nothing, held on detect and on img2img (max_connections 512)."""
    holders = [Holder(u.ports[n], b"", 700).open() for n in ("detect", "img2img")]
    time.sleep(15)
    named = list(zip(("detect", "img2img"), holders, strict=True))
    notes = {f"{n}_open": len(h.socks) for n, h in named}
    notes.update({f"{n}_closed_by_server": h.reset_by_server() for n, h in named})
    for h in holders:
        h.close()
    return {"statuses": {}, "notes": notes}


def slow_bodies(u, ctx) -> Result:
    """200 uploads declaring 20 MB each to img2img, sending 4 kB every 2 s: each holds its declared
    size in the memory ledger while it trickles (body_timeout_s 60 s)."""
    stop = threading.Event()
    first = (b"POST /api/v1/img2img?style=3 HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
             b"Content-Length: 20000000\r\n\r\n")
    rs: list[dict] = []
    t = threading.Thread(target=lambda: rs.extend(concurrently(
        lambda i: trickle(u.ports["img2img"], first, b"\0" * 4096, 2.0, stop), 200)))
    t.start()
    time.sleep(30)
    stop.set()
    t.join()
    return {"statuses": tally(rs), "notes": {"connections": len(rs)}}


def chunked_one_byte(u, ctx) -> Result:
    """Bodies in 1-byte chunks (6 bytes on the wire per body byte), 4 at once, to detect."""
    first = (b"POST /api/v1/facedetect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"1\r\nA\r\n" * 100_000
    stop = threading.Event()
    rs = concurrently(lambda i: trickle(u.ports["detect"], first, piece, 0.0, stop, max_bytes=64 << 20), 4)
    return {"statuses": tally(rs), "notes": {"sent_mb": [round(r["sent"] / 2**20, 1) for r in rs],
                                             "seconds": [round(r["s"], 1) for r in rs]}}


def multipart_fragments(u, ctx) -> Result:
    """A multipart image part full of boundary look-alikes: the pure-Python parser emits a
    callback and a slice for each (18 MB, 4 at once, to detect)."""
    boundary = "XyZ"
    part = b"\r\n-" * 6_000_000
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + part + f"\r\n--{boundary}--\r\n".encode()
    hdr = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    rs = concurrently(lambda i: request(u.ports["detect"], "POST", "/api/v1/facedetect", body, hdr), 4)
    return {"statuses": tally(rs), "notes": {"body_bytes": len(body), "max_s": round(max(r["s"] for r in rs), 2)}}


# ---- many small requests with big answers ----------------------------------------------------------
def pipelined_big_answers(u, ctx) -> Result:
    """100 connections, each 1000 pipelined GET /openapi.json (a few hundred kB each), never read."""
    one = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    size = len(request(u.ports["img2img"], "GET", "/openapi.json")["body"])
    h = Holder(u.ports["img2img"], one * 1000, 100).open()
    time.sleep(35)
    notes = {"answer_bytes": size, "connections": len(h.socks), "closed_by_server_after_35s": h.reset_by_server()}
    h.close()
    return {"statuses": {}, "notes": notes}


def probe_port_flood(u, ctx) -> Result:
    """The probe port asked for /metrics by 50 pipelining clients that never read and 32 that do."""
    h = Holder(u.health_port, b"GET /metrics HTTP/1.1\r\n\r\n" * 200, 50).open()
    rs = _for(15, 32, lambda i: request(u.health_port, "GET", "/metrics", timeout=5, keep_body=False))
    notes = {"metrics_requests": len(rs), "closed_by_server": h.reset_by_server()}
    h.close()
    return {"statuses": tally(rs), "notes": notes}


# ---- pictures that cost more than they weigh ---------------------------------------------------------
def decompression_bombs(u, ctx) -> Result:
    """40-megapixel pictures of one colour in every accepted format (a few bytes to 600 kB each):
    8 at once to detect, 4 at once to img2img (whose answer is as big as the picture)."""
    files = {"png": (I.flat_png(6324, 6324), "image/png"), "jpeg": (I.flat_jpeg(6324, 6324), "image/jpeg"),
             "webp": (I.flat_webp(6324, 6324), "image/webp"), "bmp_rle4": (I.rle4_bmp(), "image/bmp")}
    rs, notes = [], {}
    for name, (data, ctype) in files.items():
        got = concurrently(lambda i, data=data, ctype=ctype: request(u.ports["detect"], "POST",
                                                                     "/api/v1/facedetect", data,
                                                                     {"Content-Type": ctype}), 8)
        got += concurrently(lambda i, data=data, ctype=ctype: request(
            u.ports["img2img"], "POST", "/api/v1/img2img?style=3&format=jpeg", data, {"Content-Type": ctype},
            keep_body=False), 4)
        rs += got
        notes[name] = f"{len(data)} bytes: {tally(got)}, max {max(r['s'] for r in got):.1f} s"
    return {"statuses": tally(rs), "notes": notes}


def webp_animation(u, ctx) -> Result:
    data = I.webp_animation()
    rs = concurrently(lambda i: request(u.ports["detect"], "POST", "/api/v1/facedetect", data,
                                        {"Content-Type": "image/webp"}), 8)
    return {"statuses": tally(rs), "notes": {"bytes": len(data), "frames": 5000,
                                             "max_s": round(max(r["s"] for r in rs), 2)}}


def exif_bombs(u, ctx) -> Result:
    files = {"png eXIf 60000 tags": (I.exif_bomb_png(), "image/png"),
             "jpeg APP1 overlapping tags": (I.exif_bomb_jpeg(), "image/jpeg")}
    rs, notes = [], {}
    for name, (data, ctype) in files.items():
        got = concurrently(lambda i, data=data, ctype=ctype: request(u.ports["detect"], "POST",
                                                                     "/api/v1/facedetect", data,
                                                                     {"Content-Type": ctype}), 8)
        rs += got
        notes[name] = f"{len(data)} bytes: {tally(got)}"
    info = post_json(u.ports["img2img"], "/sdapi/v1/png-info", {"image": b64(I.exif_bomb_png())})
    rs.append(info)
    notes["png-info"] = f"{info['status']} {error_code(info) or ''}"
    return {"statuses": tally(rs), "notes": notes}


def slow_encode(u, ctx) -> Result:
    """Answers that are slow to encode: WebP of 40 MP (Pillow) and PNG of 40 MP, 3 at once each."""
    data = I.flat_jpeg(6324, 6324)
    rs = []
    for fmt in ("webp", "png"):
        rs += concurrently(lambda i, fmt=fmt: request(u.ports["img2img"], "POST",
                                                      f"/api/v1/img2img?style=3&format={fmt}", data,
                                                      {"Content-Type": "image/jpeg"}, keep_body=False), 3)
    return {"statuses": tally(rs), "notes": {"seconds": [round(r["s"], 1) for r in rs]}}


def header_oddities(u, ctx) -> Result:
    """Requests with 200 credential headers, 99 headers of 160 bytes, a 15 kB URL: no 5xx."""
    rs = []
    port = u.ports["detect"]
    rs.append(request(port, "GET", "/info", headers={f"X-Api-Key-{i}": "k" for i in range(200)}))
    rs.append(request(port, "GET", "/info", headers={f"X-Pad-{i}": "p" * 150 for i in range(99)}))
    rs.append(request(port, "GET", "/info?" + "a=1&" * 3800))
    return {"statuses": tally(rs), "notes": {}}


def junk_submits_under_the_limit(u, ctx) -> Result:
    """Attack 5 within the jobs body limit: 200 concurrent submits of 27 MiB whose image is
    valid base64 but no picture. Each must be read and looked at before it can be refused."""
    from bench.attack_classes import jobs_big_submits
    return jobs_big_submits(u, ctx, n=200, size=27 * 2**20)


# ---- metadata that inflates in the decoder ----------------------------------------------------------
def png_text_bombs(u, ctx) -> Result:
    """48x32 PNGs whose compressed text chunks (zTXt, iTXt) inflate to 7.9 MB each, 500 of
    them (under the 512-chunk limit, 3.9 MB on the wire): after the pixels, where a header
    reader never looks but libpng (OpenCV's decoder) keeps every one it inflates; and 64
    before them, 1 MB each, which Pillow's header read inflates (within its own 64 MB bound).
    4 at once to detect, 2 to img2img, then the webui's extras and png-info."""
    cases = {"zTXt x500 after IDAT": I.text_bomb_png(500), "iTXt x500 after IDAT": I.text_bomb_png(500, kind=b"iTXt"),
             "zTXt x64 1MB before IDAT": I.text_bomb_png(64, 1_000_000, after_pixels=False)}
    rs, notes = [], {}
    for name, data in cases.items():
        got = concurrently(lambda i, data=data: request(u.ports["detect"], "POST", "/api/v1/facedetect", data,
                                                        {"Content-Type": "image/png"}, timeout=120), 4)
        got += concurrently(lambda i, data=data: request(u.ports["img2img"], "POST", "/api/v1/img2img?style=3",
                                                         data, {"Content-Type": "image/png"}, keep_body=False,
                                                         timeout=120), 2)
        got.append(post_json(u.ports["img2img"], "/sdapi/v1/extra-single-image",
                             {"image": b64(data), "upscaler_1": "Lanczos", "upscaling_resize": 2}, keep_body=False))
        got.append(post_json(u.ports["img2img"], "/sdapi/v1/png-info", {"image": b64(data)}, keep_body=False))
        rs += got
        notes[name] = f"{len(data)} bytes: {tally(got)}, max {max(r['s'] for r in got):.1f} s"
    return {"statuses": tally(rs), "notes": notes}


# ---- clients that come straight back ----------------------------------------------------------
def _loop_clients(n: int, seconds: float, one) -> dict[str, int]:
    """n threads, each calling one(got, lock) again and again for `seconds` (a fresh connection
    each time it returns): what every answer was, tallied."""
    got: dict[str, int] = {}
    lock = threading.Lock()
    t_end = time.monotonic() + seconds

    def client(i: int) -> dict:
        while time.monotonic() < t_end:
            try:
                one(got, lock, t_end)
            except OSError as exc:
                with lock:
                    got[type(exc).__name__] = got.get(type(exc).__name__, 0) + 1
                time.sleep(0.1)
        return {}
    concurrently(client, n)
    return got


def _count(got: dict[str, int], lock: threading.Lock, key: str) -> None:
    with lock:
        got[key] = got.get(key, 0) + 1


def held_bodies_reconnecting(u, ctx) -> Result:
    """600 clients on detect, each a POST with Expect: 100-continue and 20 MB announced whose
    body never comes, reconnecting the moment they are answered (503 or 408), for 25 s: every
    answer brought its client straight back, and a probe waited behind them all."""
    head = (b"POST /api/v1/facedetect HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Expect: 100-continue\r\nContent-Length: 20000000\r\n\r\n")

    def one(got, lock, t_end):
        with socket.create_connection((HOST, u.ports["detect"]), timeout=30) as s:
            s.sendall(head)
            s.settimeout(1.0)
            data = b""
            while time.monotonic() < t_end:
                try:
                    piece = s.recv(65536)
                except TimeoutError:
                    continue
                if not piece:
                    break
                data += piece
                if data.startswith(b"HTTP/1.1 100") and b"\r\n\r\n" in data:
                    _count(got, lock, "100 (then silent)")
                    data = data.split(b"\r\n\r\n", 1)[1]
                elif b"\r\n\r\n" in data:
                    break
            _count(got, lock, data[9:12].decode(errors="replace") or "closed")
    return {"statuses": {}, "notes": {"attacker_saw": _loop_clients(600, 25, one)}}


def pollers_in_a_loop(u, ctx) -> Result:
    """600 clients on kept-alive connections long-polling one job (?wait=10) again and again for
    25 s, first a queued one, then (once it finishes) a finished one, answered at once."""
    png = b64(I.noisy_png(2000, 1500, 0.4))
    submits = [post_json(u.ports["jobs"], "/v1/jobs", {"service": "img2img", "route": "/api/v1/img2img",
                                                         "params": {"style": 3}, "image": png}) for _ in range(4)]
    queued = [json.loads(r["body"])["id"] for r in submits if r["status"] == 202]
    if not queued:
        return {"statuses": tally(submits), "notes": {"skipped": "no job was taken"}}
    req = f"GET /v1/jobs/{queued[-1]}?wait=10&result=false HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    def one(got, lock, t_end):
        with socket.create_connection((HOST, u.ports["jobs"]), timeout=20) as s:
            while time.monotonic() < t_end:
                s.sendall(req)
                data = b""
                while b"\r\n\r\n" not in data:
                    piece = s.recv(65536)
                    if not piece:
                        raise ConnectionError("closed")
                    data += piece
                head, _, rest = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(rest) < length and (piece := s.recv(65536)):
                    rest += piece
                _count(got, lock, head[9:12].decode())
                if b"connection: close" in head.lower():
                    break
    return {"statuses": {}, "notes": {"poll_answers": _loop_clients(600, 25, one)}}


OWN_ATTACKS = [
    ("B1 JSON of millions of [] (GIL, memory)", json_tiny_containers),
    ("B2 numbers at the edges", json_odd_numbers),
    ("B3 slowloris headers (400 conns)", slowloris_headers),
    ("B4 connection flood (700 x 2 idle)", connection_flood),
    ("B5 slow bodies holding the budget", slow_bodies),
    ("B6 chunked 1-byte chunks", chunked_one_byte),
    ("B7 multipart boundary look-alikes", multipart_fragments),
    ("B8 pipelined big answers unread", pipelined_big_answers),
    ("B9 probe port /metrics flood", probe_port_flood),
    ("B10 40 MP bombs in every format", decompression_bombs),
    ("B11 WebP animation 5000 frames", webp_animation),
    ("B12 EXIF bombs", exif_bombs),
    ("B13 slow encode (40 MP webp/png)", slow_encode),
    ("B14 header oddities", header_oddities),
    ("B15 200 junk submits under the body limit", junk_submits_under_the_limit),
    ("B16 PNG text chunks that inflate (zTXt/iTXt)", png_text_bombs),
    ("B17 600 held bodies, straight back when answered", held_bodies_reconnecting),
    ("B18 600 long pollers in a loop", pollers_in_a_loop),
]

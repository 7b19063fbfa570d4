"""Which step of a request holds the GIL (and with it the event loop and the probe listener)?

    .venv/bin/python -m bench.gil_hold

Each step runs on a worker thread, as the service's CPU pool runs it, while another thread
sleeps 5 ms again and again; the sleeper's overshoot is how long it waited for the GIL
(the issue's measure: "a third thread's 5 ms sleep overshoot"). A step that releases the
GIL (OpenCV's codecs) leaves the sleeper at ~0; one that holds it for its whole duration
shows it as the max. The machine's own load adds noise to every row (2 shared cores): read
max against the step's duration. Writes bench/results/gil_hold.json.
"""

from __future__ import annotations

import base64
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

from bench.common import pct, table, write_result


def measure(step: Callable[[], object], repeat: int = 2) -> dict:
    over: list[float] = []
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.005)
            over.append((time.perf_counter() - t - 0.005) * 1000)

    th = threading.Thread(target=sleeper)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(repeat):
        w = threading.Thread(target=step)
        w.start()
        w.join()
    took = (time.perf_counter() - t0) / repeat
    stop.set()
    th.join()
    return {"step_s": round(took, 3), "max_ms": round(max(over), 1), "p99_ms": round(pct(over, 99), 1)}


@contextlib.contextmanager
def quiet_stderr():
    """Pillow's warnings go to stderr (as they do in a service): keep this table readable."""
    fd = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(fd, 2)
        os.close(devnull)
        os.close(fd)


def steps() -> dict[str, Callable[[], object]]:
    import numpy as np

    from services.jobs.payload import parse_envelope
    from services.runtime.codecs.forms import parse_json, parse_multipart
    from services.runtime.codecs.images import DecodeLimits, decode_probed, encode_image, probe_image
    from tests import images as I

    lim = DecodeLimits(40_000_000)
    tiny = I.tiny_containers_json(18_000_000)
    big_png = I.noisy_png(4000, 3000, 0.42)
    flat_png = I.flat_png(6324, 6324)
    anim = I.webp_animation()
    exif = I.exif_bomb_png()
    pic = np.zeros((6324, 6324, 3), np.uint8)
    result = os.urandom(27_000_000)
    submit = b'{"service": "detect", "route": "/api/v1/facedetect", "image": "' + b"A" * 29_999_900 + b'"}'
    boundary = "XyZ"
    multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a\"\r\n\r\n".encode()
                 + b"\r\n-" * 6_000_000 + f"\r\n--{boundary}--\r\n".encode())
    h_big, h_anim = probe_image(big_png, lim), probe_image(anim, lim)
    return {
        "json.loads 18 MB of [] (parse_json)": lambda: parse_json(tiny, 32),
        "jobs submit 30 MB (parse_envelope)": lambda: parse_envelope(submit, 33),
        "probe_image 12 MP PNG 15 MB (Pillow load via getexif)": lambda: probe_image(big_png, lim),
        "probe_image 6324px flat PNG": lambda: probe_image(flat_png, lim),
        "decode_probed 12 MP PNG (OpenCV)": lambda: decode_probed(big_png, h_big),
        "decode_probed animated WebP 40 MP canvas": lambda: decode_probed(anim, h_anim),
        "probe_image PNG EXIF bomb (60000 tags)": lambda: probe_image(exif, lim),
        "encode_image 40 MP webp (OpenCV above 0.26 MP)": lambda: encode_image(pic, "webp"),
        "encode_image 40 MP png (OpenCV)": lambda: encode_image(pic, "png"),
        "base64 of a 27 MB result in one call": lambda: base64.b64encode(result),
        "parse_multipart 18 MB of boundary look-alikes": lambda: parse_multipart(
            multipart, f"multipart/form-data; boundary={boundary}", 64),
    }


def main() -> int:
    rows, doc = [], {}
    with quiet_stderr():
        for name, step in steps().items():
            try:
                got = measure(step)
            except Exception as exc:  # noqa: BLE001 - a refused input still tells how long it held
                got = {"error": repr(exc)[:120]}
            doc[name] = got
            rows.append((name, got.get("step_s", "-"), got.get("max_ms", "-"), got.get("p99_ms", "-"),
                         got.get("error", "")))
    path = write_result("gil_hold", {"steps": doc, "note": "2 shared cores; a 5 ms sleeper's overshoot"})
    print(table(rows, ("step (worker thread)", "step s", "sleeper max overshoot ms", "p99 ms", "error")))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())



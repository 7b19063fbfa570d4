"""Detect service: throughput and latency served vs the bare backend, side by side.

    .venv/bin/python -m bench.detect_bench [--duration 12]

Bare: the same CenterFace backend called in-process, same images, same thread count,
decode included (the served path decodes too). Served: the real service process over
HTTP at concurrency 1, 8 and 32, batching off (max_batch_size 1) and on (8).
Targets (issue 4): served/bare throughput >= 0.9 at concurrency 32; serving overhead
(served p50 - bare p50 at concurrency 1) <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from bench.common import bench_images, pct, service, table, timed_loop, write_result

APP = "services.detect.app:create_app"
THREADS = 1
MAX_SIDE = 320


def bare_backend(batch: int):
    os.environ["ONECARD_SERVICE_THREADS"] = str(THREADS)
    import onecard
    from services.detect.backends import CenterFaceBackend, DetectItem
    from services.detect.settings import DetectSettings
    from services.runtime.codecs.images import DecodeLimits, decode_image
    from services.runtime.device.threads import apply_threads
    apply_threads(THREADS)
    b = CenterFaceBackend(DetectSettings(max_side=MAX_SIDE, max_batch_size=max(batch, 2)))
    b.load(onecard.Setup("detect", b.settings, THREADS))
    limits = DecodeLimits(max_pixels=10**9)
    # the service decodes a JPEG the model shrinks anyway at reduced scale: so does the baseline
    return b, DetectItem, lambda data, _unused=None: decode_image(data, limits, MAX_SIDE)


def run_bare(duration: float, batch: int) -> dict:
    backend, DetectItem, decode_image = bare_backend(batch)
    images = bench_images()
    backend.infer_batch([DetectItem(decode_image(images[0][0], 10**9).rgb, 0.5, None)])  # warm

    def one(i):
        items = [DetectItem(decode_image(images[(i * batch + k) % 3][0], 10**9).rgb, 0.5, None) for k in range(batch)]
        backend.infer_batch(items)

    lat = timed_loop(one, duration)
    return {"throughput_rps": batch * len(lat) / sum(lat), "p50_ms": 1000 * statistics.median(lat),
            "p99_ms": 1000 * pct(lat, 99), "runs": len(lat)}


def run_overhead(rounds: int = 20, per_round: int = 10) -> dict:
    """Concurrency 1, one image, bare and served calls interleaved round by round so that
    both see the same machine state. Two figures: served p50 - bare p50, and the
    per-request time outside decode and inference (client + HTTP + queue + JSON), read
    from each response's Server-Timing."""
    import http.client
    backend, DetectItem, decode_image = bare_backend(1)
    data = bench_images()[0][0]

    def bare_call():
        backend.infer_batch([DetectItem(decode_image(data, 10**9).rgb, 0.5, None)])

    bare_call()
    bare, served, outside = [], [], []
    settings = {"backend": "centerface", "max_side": MAX_SIDE, "max_batch_size": 1}
    with service(APP, settings, threads=THREADS) as svc:
        # the leanest client there is (http.client, one kept-alive connection), so that
        # the figure is the server's cost rather than a client library's
        conn = http.client.HTTPConnection("127.0.0.1", svc.port)

        def call():
            conn.request("POST", "/api/v1/facedetect", body=data, headers={"content-type": "image/png"})
            r = conn.getresponse()
            r.read()
            return r

        for _ in range(3):
            call()
        for _ in range(rounds):
            bare += timed_loop(lambda i: bare_call(), 0, min_runs=per_round)
            for _ in range(per_round):
                t = time.perf_counter()
                r = call()
                total = time.perf_counter() - t
                stages = dict(p.split(";dur=") for p in r.getheader("server-timing").split(", "))
                served.append(total)
                outside.append(total - (float(stages["decode"]) + float(stages["infer"])) / 1000)
        conn.close()
    return {"bare_p50_ms": 1000 * statistics.median(bare), "served_p50_ms": 1000 * statistics.median(served),
            "difference_p50_ms": 1000 * (statistics.median(served) - statistics.median(bare)),
            "outside_model_p50_ms": 1000 * statistics.median(outside),
            "outside_model_p99_ms": 1000 * pct(outside, 99), "requests": len(served)}


def run_served(batch: int, concurrencies: list[int], duration: float) -> dict:
    from bench.loadgen import run_load
    images = bench_images()
    settings = {"backend": "centerface", "max_side": MAX_SIDE, "max_batch_size": batch, "max_queue": 1000}
    out = {}
    with service(APP, settings, threads=THREADS) as svc:
        url = svc.url + "/api/v1/facedetect"
        for c in concurrencies:
            res = asyncio.run(run_load(url, lambda i: images[i % 3][0], {"content-type": "image/png"}, c,
                                       duration_s=duration, warmup=3))
            out[c] = res.summary()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=12.0)
    args = ap.parse_args()
    conc = [1, 8, 32]
    bare = {1: run_bare(args.duration, 1), 8: run_bare(args.duration, 8)}
    overhead = run_overhead()
    served = {1: run_served(1, conc, args.duration), 8: run_served(8, conc, args.duration)}
    rows = []
    for batch in (1, 8):
        for c in conc:
            s = served[batch][c]
            rows.append((f"batch {batch}", c, f"{s['throughput_rps']:.1f}", f"{bare[batch]['throughput_rps']:.1f}",
                         f"{s['throughput_rps'] / bare[batch]['throughput_rps']:.2f}", s["p50_ms"], s["p99_ms"],
                         s["statuses"]))
    doc = {"threads": THREADS, "max_side": MAX_SIDE, "duration_s": args.duration, "bare": bare,
           "served": served,
           "ratio_c32_batching": served[8][32]["throughput_rps"] / bare[8]["throughput_rps"],
           "ratio_c32_no_batching": served[1][32]["throughput_rps"] / bare[1]["throughput_rps"],
           "overhead_c1": overhead,
           "targets": {"ratio_c32": 0.9, "overhead_p50_ms": 2.0}}
    path = write_result("detect", doc)
    print(table(rows, ("mode", "conc", "served rps", "bare rps", "served/bare", "p50 ms", "p99 ms", "statuses")))
    print(f"serving overhead at concurrency 1, one image, interleaved: served p50 {overhead['served_p50_ms']:.2f} ms"
          f" - bare p50 {overhead['bare_p50_ms']:.2f} ms = {overhead['difference_p50_ms']:.2f} ms; outside decode"
          f" and inference p50 {overhead['outside_model_p50_ms']:.2f} ms,"
          f" p99 {overhead['outside_model_p99_ms']:.2f} ms")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

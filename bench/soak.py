"""Soak: 10k requests across both services through the supervisor; zero errors, and the
RSS of every process grows at most 5 % after warm-up.

    .venv/bin/python -m bench.soak [--requests 10000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

from bench.common import table, write_result
from bench.loadgen import run_load
from tests.harness import SupervisorRun, free_port
from tests.images import astronaut, encode

PNG = {"content-type": "image/png"}


def rss_of(run: SupervisorRun) -> dict[str, int]:
    out = {"supervisor": psutil.Process(run.proc.pid).memory_info().rss}
    for s in run.status_doc()["services"]:
        out[s["name"]] = psutil.Process(s["pid"]).memory_info().rss
    return out


async def mixed(detect_url: str, img2img_url: str, body: bytes, total: int, conc: int) -> tuple:
    n_img = total // 5  # one img2img request for every four detections
    det, img = await asyncio.gather(
        run_load(detect_url, body, PNG, max(1, conc - 2), total=total - n_img, duration_s=3600),
        run_load(img2img_url, body, PNG, 2, total=n_img, duration_s=3600))
    return det, img


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=1_000)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    body = encode(np.asarray(Image.fromarray(astronaut()).resize((128, 128))))
    tmp = Path(tempfile.mkdtemp(prefix="onecard-soak-"))
    services = {
        "detect": {"app": "services.detect.app:create_app", "port": free_port(), "threads": 1,
                   "settings": {"max_side": 128, "max_queue": 1000}},
        "img2img": {"app": "services.img2img.app:create_app", "port": free_port(), "threads": 1,
                    "settings": {"max_side": 128, "max_queue": 1000}},
    }
    det_url = f"http://127.0.0.1:{services['detect']['port']}/api/v1/facedetect"
    img_url = f"http://127.0.0.1:{services['img2img']['port']}/api/v1/img2img?style=7"
    with SupervisorRun(tmp, services, liveness_period_s=5.0) as run:
        run.wait_ready(timeout=300)
        asyncio.run(mixed(det_url, img_url, body, args.warmup, args.concurrency))
        before = rss_of(run)
        t0 = time.monotonic()
        det, img = asyncio.run(mixed(det_url, img_url, body, args.requests, args.concurrency))
        elapsed = time.monotonic() - t0
        after = rss_of(run)
        alive = run.proc.poll() is None
    growth = {k: (after[k] - before[k]) / before[k] for k in before}
    errors = det.errors + img.errors + sum(n for s, n in {**det.statuses}.items() if s != 200) \
        + sum(n for s, n in img.statuses.items() if s != 200)
    doc = {"requests": args.requests, "warmup": args.warmup, "elapsed_s": elapsed,
           "detect": det.summary(), "img2img": img.summary(), "errors": errors, "supervisor_alive": alive,
           "rss_before": before, "rss_after": after, "rss_growth": growth,
           "targets": {"errors": 0, "rss_growth": 0.05}}
    path = write_result("soak", doc)
    print(table([(k, f"{before[k] / 2**20:.1f}", f"{after[k] / 2**20:.1f}", f"{100 * growth[k]:+.2f}%")
                 for k in before], ("process", "RSS MB after warm-up", "RSS MB at end", "growth")))
    print(f"{det.summary()['requests'] + img.summary()['requests']} requests in {elapsed:.0f} s, errors {errors}; "
          f"detect p99 {det.summary()['p99_ms']} ms, img2img p99 {img.summary()['p99_ms']} ms")
    print(f"written: {path}")
    ok = errors == 0 and alive and all(g <= 0.05 for g in growth.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

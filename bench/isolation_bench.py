"""Isolation, the reason onecard exists: detect latency alone and while img2img is kept
saturated, onecard (two services under the supervisor) side by side with the naive
design (one process, both routes behind one shared single-thread executor). Also
img2img throughput served vs its bare backend.

    .venv/bin/python -m bench.isolation_bench [--duration 20]
    .venv/bin/python -m bench.isolation_bench --gpu    # both on one CUDA card: CenterFace on
        # onnxruntime's CUDA provider beside SD-1.5-architecture fp16 img2img (random weights),
        # time-sliced, then under MPS when its binaries are there

Targets (issue 5): detect p99 under img2img load <= 1.5x detect p99 alone, and >= 5x
better than the naive baseline's; img2img served/bare throughput >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

from bench.common import bench_images, service, table, timed_loop, write_result
from bench.loadgen import run_load
from tests.harness import SupervisorRun, free_port

DETECT = {"backend": "centerface", "max_side": 320}
IMG2IMG = {"backend": "style", "max_side": 512}
PNG = {"content-type": "image/png"}
GPU_DETECT = {"backend": "centerface", "max_side": 640, "device": "cuda"}
GPU_IMG2IMG = {"backend": "diffusers", "max_side": 512, "device": "cuda", "dtype": "float16", "scheduler": "ddim",
               "max_batch_size": 8, "max_queue": 64, "request_timeout_s": 600}


def gpu_images() -> list[tuple[bytes, str]]:
    """Without insightface's group photo: the GPU image carries no insightface."""
    from tests.images import astronaut, coffee, encode
    return [(encode(astronaut()), "image/png"), (encode(coffee()), "image/png"), (encode(astronaut()), "image/png")]


async def detect_with_load(detect_url: str, img2img_url: str | None, duration: float, img2img_conc: int,
                           images: list[tuple[bytes, str]] | None = None) -> dict:
    images = images or bench_images()
    det = run_load(detect_url, lambda i: images[i % 3][0], PNG, 1, duration_s=duration, warmup=2)
    if img2img_url is None:
        return {"detect": (await det).summary()}
    load = run_load(img2img_url, images[0][0], PNG, img2img_conc, duration_s=duration + 2, timeout_s=300)
    load_task = asyncio.ensure_future(load)
    await asyncio.sleep(2.0)  # img2img saturated before detect is measured
    d = await det
    i = await load_task
    return {"detect": d.summary(), "img2img": i.summary()}


def measure(detect_url: str, img2img_url: str, duration: float, conc: int,
            images: list[tuple[bytes, str]] | None = None) -> dict:
    alone = asyncio.run(detect_with_load(detect_url, None, duration, conc, images))
    loaded = asyncio.run(detect_with_load(detect_url, img2img_url, duration, conc, images))
    return {"alone": alone, "loaded": loaded}


def onecard_run(duration: float, conc: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="onecard-iso-"))
    detect = {"app": "services.detect.app:create_app", "port": free_port(), "threads": 1, "settings": DETECT}
    img2img = {"app": "services.img2img.app:create_app", "port": free_port(), "threads": 1, "settings": IMG2IMG}
    with SupervisorRun(tmp, {"detect": detect, "img2img": img2img}, liveness_period_s=5.0,
                       startup_timeout_s=300.0) as run:
        run.wait_ready(timeout=300)
        return measure(f"http://127.0.0.1:{detect['port']}/api/v1/facedetect",
                       f"http://127.0.0.1:{img2img['port']}/api/v1/img2img?style=3", duration, conc)


def table_rows(name: str, doc: dict) -> list[tuple]:
    """detect alone and beside saturated img2img, as table rows."""
    rows = []
    for which in ("alone", "loaded"):
        d = doc[which]["detect"]
        i = doc[which].get("img2img", {})
        rows.append((name, "detect alone" if which == "alone" else "detect + img2img saturated",
                     d["p50_ms"], d["p95_ms"], d["p99_ms"], d["throughput_rps"], i.get("throughput_rps", "-"),
                     {**d["statuses"], **({"img2img": i["statuses"]} if i else {})}))
    return rows


def gpu_run(duration: float, conc: int, model: Path, mps: bool) -> dict:
    """detect alone, then beside img2img kept busy by `conc` clients, both on the card."""
    tmp = Path(tempfile.mkdtemp(prefix="onecard-iso-gpu-"))
    detect = {"app": "services.detect.app:create_app", "port": free_port(), "threads": 2,
              "gpu_memory_fraction": 0.15, "settings": {**GPU_DETECT}}
    img2img = {"app": "services.img2img.app:create_app", "port": free_port(), "threads": 2,
               "gpu_memory_fraction": 0.75, "settings": {**GPU_IMG2IMG, "model_path": str(model)}}
    with SupervisorRun(tmp, {"detect": detect, "img2img": img2img}, gpu={"mps": mps}, liveness_period_s=5.0,
                       startup_timeout_s=300.0) as run:
        doc = run.wait_ready(timeout=300)
        out = measure(f"http://127.0.0.1:{detect['port']}/api/v1/facedetect",
                      f"http://127.0.0.1:{img2img['port']}/api/v1/img2img?steps=20&strength=0.75&prompt=a+photo",
                      duration, conc, gpu_images())
        out["mps"] = doc.get("mps")
        out["stats"] = {name: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{svc['port']}/stats",
                                                                timeout=30).read())
                        for name, svc in (("detect", detect), ("img2img", img2img))}
        return out


def gpu_main(args) -> int:
    from bench.img2img_bench import sd15_random
    model = Path(args.sd15) if args.sd15 else sd15_random(Path(tempfile.mkdtemp(prefix="onecard-iso-sd15-")) / "sd15")
    runs = {"time_sliced": gpu_run(args.duration, args.img2img_concurrency, model, mps=False)}
    if shutil.which("nvidia-cuda-mps-control"):
        runs["mps"] = gpu_run(args.duration, args.img2img_concurrency, model, mps=True)
    rows = [row for name, doc in runs.items() for row in table_rows(name, doc)]
    ratios = {name: doc["loaded"]["detect"]["p99_ms"] / doc["alone"]["detect"]["p99_ms"] for name, doc in runs.items()}
    doc = {"duration_s": args.duration, "img2img_concurrency": args.img2img_concurrency, "detect": GPU_DETECT,
           "img2img": GPU_IMG2IMG, "runs": runs, "detect_p99_loaded_over_alone": ratios,
           "mps_binaries": shutil.which("nvidia-cuda-mps-control") is not None}
    path = write_result("isolation-gpu", doc)
    print(table(rows, ("sharing", "scenario", "p50 ms", "p95 ms", "p99 ms", "detect rps", "img2img rps", "statuses")))
    for name, r in ratios.items():
        print(f"{name}: detect p99 loaded / alone {r:.2f}")
    print(f"written: {path}")
    return 0


def naive_run(duration: float, conc: int) -> dict:
    with service("bench.naive_app:create_app", {"detect": DETECT, "img2img": IMG2IMG}, threads=2) as svc:
        return measure(svc.url + "/api/v1/facedetect", svc.url + "/api/v1/img2img?style=3", duration, conc)


def img2img_throughput(duration: float, conc: int) -> dict:
    os.environ["ONECARD_SERVICE_THREADS"] = "1"
    from PIL import Image

    import onecard
    from services.img2img.params import Img2ImgItem, parse_style
    from services.img2img.progress import Progress
    from services.img2img.settings import Img2ImgSettings
    from services.img2img.style import StyleBackend
    from services.runtime.codecs.images import DecodeLimits, decode_image, encode_image
    from services.runtime.device.threads import apply_threads
    apply_threads(1)
    cfg = Img2ImgSettings.model_validate(IMG2IMG)
    backend = StyleBackend(cfg, Progress())
    backend.load(onecard.Setup("img2img", cfg, 1))
    data = bench_images()[0][0]
    limits = DecodeLimits(max_pixels=10**9)

    def bare_call(i):
        img = decode_image(data, limits, cfg.max_side)
        item = Img2ImgItem(Image.fromarray(img.rgb), "", "", 0.75, 1, 0.0, 0, (img.width, img.height),
                           style_weights=parse_style(3))
        backend.prepare(item)
        out = backend.postprocess(item, backend.infer_batch([item])[0])
        encode_image(np.asarray(Image.fromarray(out).resize(item.out_size)), "png")

    bare_call(0)
    # interleaved rounds, so that bare and served see the same machine state
    rounds = 4
    bare: list[float] = []
    served_ok, served_s, statuses = 0, 0.0, {}
    with service("services.img2img.app:create_app", IMG2IMG, threads=1) as svc:
        url = svc.url + "/api/v1/img2img?style=3"
        asyncio.run(run_load(url, data, PNG, conc, total=conc, warmup=2, timeout_s=300))
        for _ in range(rounds):
            bare += timed_loop(bare_call, duration / rounds)
            res = asyncio.run(run_load(url, data, PNG, conc, duration_s=duration / rounds, timeout_s=300))
            served_ok += res.ok
            served_s += res.elapsed_s
            for k, v in res.statuses.items():
                statuses[str(k)] = statuses.get(str(k), 0) + v
    bare_rps = len(bare) / sum(bare)
    served_rps = served_ok / served_s
    return {"bare_rps": bare_rps, "bare_p50_ms": 1000 * statistics.median(bare), "rounds": rounds,
            "served": {"throughput_rps": served_rps, "ok": served_ok, "statuses": statuses},
            "ratio": served_rps / bare_rps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--img2img-concurrency", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="both services on CUDA (see the module's docstring)")
    ap.add_argument("--sd15", default="", help="with --gpu: an SD-1.5 pipeline folder (default: random weights)")
    args = ap.parse_args()
    if args.gpu:
        return gpu_main(args)
    ours = onecard_run(args.duration, args.img2img_concurrency)
    naive = naive_run(args.duration, args.img2img_concurrency)
    thr = img2img_throughput(args.duration, args.img2img_concurrency)

    def p99(doc, which):
        return doc[which]["detect"]["p99_ms"]

    ours_ratio = p99(ours, "loaded") / p99(ours, "alone")
    vs_naive = p99(naive, "loaded") / p99(ours, "loaded")
    rows = [row for name, doc in (("onecard", ours), ("naive", naive)) for row in table_rows(name, doc)]
    doc = {"duration_s": args.duration, "img2img_concurrency": args.img2img_concurrency, "detect": DETECT,
           "img2img": IMG2IMG, "onecard": ours, "naive": naive, "img2img_throughput": thr,
           "detect_p99_loaded_over_alone": ours_ratio, "naive_p99_over_onecard_p99_loaded": vs_naive,
           "targets": {"loaded_over_alone": 1.5, "naive_over_onecard": 5.0, "img2img_served_over_bare": 0.95}}
    path = write_result("isolation", doc)
    print(table(rows, ("design", "scenario", "p50 ms", "p95 ms", "p99 ms", "detect rps", "img2img rps", "statuses")))
    print(f"onecard detect p99 loaded / alone: {ours_ratio:.2f}  (target <= 1.5)")
    print(f"naive detect p99 loaded / onecard detect p99 loaded: {vs_naive:.1f}x  (target >= 5)")
    print(f"img2img served/bare throughput: {thr['ratio']:.2f}  (served {thr['served']['throughput_rps']:.2f} rps, "
          f"bare {thr['bare_rps']:.2f} rps; target >= 0.95)")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""img2img served vs the bare pipeline, batched, and /healthz under each load (issue 10).

For each concurrency c in 1, 4, 8: the bare baseline calls the backend in-process with a
batch of min(c, max_batch_size) items (the best the pipeline can do for c clients:
prepare, one pipeline call, PNG encode); the service is driven by c concurrent clients.
Both are measured in images per second, in interleaved rounds so that they see the same
machine state. Meanwhile /healthz is polled every 50 ms on the service's public port and
on its probe socket: p50/p99 under each load.

    .venv/bin/python -m bench.img2img_bench                 # CPU: tiny random SD pipeline, 64x64
    .venv/bin/python -m bench.img2img_bench --gpu           # CUDA: SD-1.5-architecture fp16, 512x512,
                                                            #  random weights (nothing downloaded)

Goals: served >= 0.9 of bare batched throughput at concurrency 8 on a GPU; /healthz p99
<= 20 ms under any load the service accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import io
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import pct, service, table, timed_loop, write_result
from bench.loadgen import run_load

CONCURRENCY = (1, 4, 8)


def sd15_random(path: Path) -> Path:
    """An SD-1.5-architecture pipeline with random weights, saved like a real one (GPU runs)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionImg2ImgPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from tests.models import tiny_sd_img2img
    tok_src = tiny_sd_img2img(Path(tempfile.mkdtemp()) / "tok")  # a CLIP tokenizer built offline
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768)  # SD 1.5's defaults
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=2, sample_size=512)
    from transformers import CLIPTokenizer
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_src / "tokenizer"))
    text = CLIPTextModel(CLIPTextConfig(vocab_size=tokenizer.vocab_size, hidden_size=768, intermediate_size=3072,
                                        num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=1))
    pipe = StableDiffusionImg2ImgPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet,
                                          scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
                                          requires_safety_checker=False)
    pipe.save_pretrained(str(path))
    return path


def batching_now(url: str) -> dict:
    """The service's cumulative batching figures (/stats): calls, items run, time waited."""
    b = json.loads(urllib.request.urlopen(url + "/stats", timeout=30).read())["batching"]
    return {"batches": b["batches"], "items": (b["mean_batch_size"] or 0) * b["batches"],
            "waited_s": b["waited_s"], "cost": b["cost"]}


class HealthPoller:
    """GETs /healthz every period on the public port and over the probe socket."""

    def __init__(self, port: int, probe_socket: str, period_s: float = 0.05):
        self.port, self.probe_socket, self.period_s = port, probe_socket, period_s
        self.public: list[float] = []
        self.probe: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from tests.service_harness import probe
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                c.request("GET", "/healthz")
                ok = c.getresponse().status == 200
                c.close()
                self.public.append(time.perf_counter() - t)
                t = time.perf_counter()
                status, _ = probe(self.probe_socket, "/healthz", timeout=10)
                self.probe.append(time.perf_counter() - t)
                if not ok or status != 200:
                    self.failures += 1
            except OSError:
                self.failures += 1
            self._stop.wait(self.period_s)

    def summary(self) -> dict:
        def ms(values, q):
            return round(1000 * pct(values, q), 2) if values else None
        return {"public_p50_ms": ms(self.public, 50), "public_p99_ms": ms(self.public, 99),
                "probe_p50_ms": ms(self.probe, 50), "probe_p99_ms": ms(self.probe, 99),
                "samples": len(self.public), "failures": self.failures}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="SD-1.5 architecture, fp16, 512x512 on CUDA")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per measurement, per side")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--strength", type=float, default=0.75)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY),
                    help="client counts to measure (default: 1 4 8)")
    args = ap.parse_args()

    from tests.models import tiny_sd_img2img
    workdir = Path(tempfile.mkdtemp(prefix="onecard-img2img-bench-"))
    side = 512 if args.gpu else 64
    model = sd15_random(workdir / "sd15") if args.gpu else tiny_sd_img2img(workdir / "tiny-sd")
    settings = {"backend": "diffusers", "model_path": str(model), "max_side": side, "scheduler": "ddim",
                "max_batch_size": args.max_batch, "max_queue": 64, "request_timeout_s": 600,
                "device": "cuda" if args.gpu else "cpu", "dtype": "float16" if args.gpu else "float32"}
    rgb = np.random.default_rng(0).integers(0, 255, (side, side, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    body = buf.getvalue()
    query = f"?steps={args.steps}&strength={args.strength}&prompt=a+photo"
    threads = 1 if not args.gpu else 2

    # ---- the bare pipeline, in this process -------------------------------------------
    os.environ["ONECARD_SERVICE_THREADS"] = str(threads)
    import onecard
    from services.img2img.params import Img2ImgItem
    from services.img2img.progress import Progress
    from services.img2img.sd import DiffusersBackend
    from services.img2img.settings import Img2ImgSettings
    from services.runtime.codecs.images import encode_image
    from services.runtime.device.threads import apply_threads
    backend = DiffusersBackend(Img2ImgSettings.model_validate(settings), Progress())
    backend.load(onecard.Setup("img2img", backend.settings, threads))
    apply_threads(threads)

    def bare_batch(n: int):
        def call(i: int) -> None:
            items = []
            for k in range(n):
                item = Img2ImgItem(Image.fromarray(rgb), "a photo", "", args.strength, args.steps, 7.5,
                                   i * n + k, (side, side))
                backend.prepare(item)
                items.append(item)
            for out in backend.infer_batch(items):
                encode_image(out, "png")
        return call

    rows, doc = [], {"mode": "gpu" if args.gpu else "cpu", "side": side, "steps": args.steps,
                     "strength": args.strength, "max_batch": args.max_batch, "by_concurrency": {}}
    with service("services.img2img.app:create_app", settings, threads=threads) as svc:
        url = svc.url + "/api/v1/img2img" + query
        asyncio.run(run_load(url, body, {"content-type": "image/png"}, 2, total=4, timeout_s=600))
        for c in args.concurrency:
            batch = min(c, args.max_batch)
            call = bare_batch(batch)
            call(0)  # warm
            bare_s, bare_n, served_ok, served_s = 0.0, 0, 0, 0.0
            before = batching_now(svc.url)
            with HealthPoller(svc.port, svc.probe_socket) as health:
                for _ in range(2):  # interleaved rounds
                    lat = timed_loop(call, args.duration / 2, min_runs=2)
                    bare_s += sum(lat)
                    bare_n += batch * len(lat)
                    res = asyncio.run(run_load(url, body, {"content-type": "image/png"}, c,
                                               duration_s=args.duration / 2, timeout_s=600))
                    served_ok += res.ok
                    served_s += res.elapsed_s
            bare_ips, served_ips = bare_n / bare_s, served_ok / served_s
            h = health.summary()
            after = batching_now(svc.url)
            calls = after["batches"] - before["batches"]
            mean_batch = (after["items"] - before["items"]) / calls if calls else None
            doc["by_concurrency"][str(c)] = {"bare_images_per_s": round(bare_ips, 3), "bare_batch": batch,
                                             "served_images_per_s": round(served_ips, 3),
                                             "served_over_bare": round(served_ips / bare_ips, 3), "healthz": h,
                                             "served_calls": calls, "served_mean_batch": mean_batch,
                                             "waited_s": round(after["waited_s"] - before["waited_s"], 3)}
            rows.append((c, batch, f"{bare_ips:.2f}", f"{served_ips:.2f}", f"{served_ips / bare_ips:.2f}",
                         "-" if mean_batch is None else f"{mean_batch:.2f}",
                         f"{h['public_p50_ms']} / {h['public_p99_ms']}", f"{h['probe_p50_ms']} / {h['probe_p99_ms']}",
                         h["failures"]))
        doc["cost_model"] = batching_now(svc.url)["cost"]
        idle = HealthPoller(svc.port, svc.probe_socket)
        with idle:
            time.sleep(3)
        doc["healthz_idle"] = idle.summary()
    print("cost model:", json.dumps(doc["cost_model"]))
    print(table(rows, ("concurrency", "bare batch", "bare img/s", "served img/s", "served/bare", "served batch",
                       "/healthz p50/p99 ms", "probe p50/p99 ms", "health failures")))
    print(f"idle /healthz p50/p99: {doc['healthz_idle']['public_p50_ms']} / {doc['healthz_idle']['public_p99_ms']} ms")
    print("written:", write_result("img2img-gpu" if args.gpu else "img2img", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

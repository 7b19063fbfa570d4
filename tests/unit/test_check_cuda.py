"""deploy/check_cuda.py, the image build's proof that torch and onnxruntime are one CUDA stack
that loads: its rules on recorded facts, and the real script on this host's libraries."""

from __future__ import annotations

import copy
import subprocess
import sys

from deploy.check_cuda import CUDA_SONAMES, DRIVER_SONAME, problems
from tests.harness import ROOT

TORCH = {"version": "2.13.0+cu130", "cuda": "13.0", "cudnn": 92000}
ORT = {"version": "1.31.1", "cuda": "13.0",
       "providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
       "sonames": {name: None for name in CUDA_SONAMES[13]},
       "provider_present": True, "provider_unresolved": []}


def facts(**changes):
    torch, ort = copy.deepcopy(TORCH), copy.deepcopy(ORT)
    for key, value in changes.items():
        lib, field = key.split("__")
        (torch if lib == "torch" else ort)[field] = value
    return torch, ort


def test_one_cuda_13_stack_whose_libraries_load_passes():
    assert problems(*facts(), cuda_major=13, device=False) == []


def test_the_cpu_onnxruntime_wheel_is_named():
    found = problems(*facts(ort__providers=["AzureExecutionProvider", "CPUExecutionProvider"]), 13, False)
    assert len(found) == 1 and "no CUDAExecutionProvider" in found[0]


def test_a_cpu_torch_build_is_named():
    found = problems(*facts(torch__cuda=None, torch__cudnn=None, torch__version="2.13.0+cpu"), 13, False)
    assert found == ["torch 2.13.0+cpu is a CPU build (no CUDA)"]


def test_different_cuda_majors_are_refused():
    # the failure of the first image: onnxruntime-gpu for CUDA 12 beside torch's CUDA 13 build
    found = problems(*facts(ort__cuda="12.8"), 13, False)
    assert found == ["onnxruntime 1.31.1 is built for CUDA 12.8, expected 13.x"]
    assert "torch 2.13.0+cu130 is built for CUDA 13.0, expected 12.x" in problems(*facts(), 12, False)


def test_a_library_the_provider_opens_later_must_load_now():
    error = "libcudnn.so.9: cannot open shared object file: No such file or directory"
    found = problems(*facts(ort__sonames={**ORT["sonames"], "libcudnn.so.9": error}), 13, False)
    assert found == [f"onnxruntime's CUDA provider needs libcudnn.so.9, which does not load: {error}"]


def test_only_the_driver_may_be_missing_at_build_time():
    assert problems(*facts(ort__provider_unresolved=[DRIVER_SONAME]), 13, False) == []
    found = problems(*facts(ort__provider_unresolved=["libcublasLt.so.13", DRIVER_SONAME]), 13, False)
    assert found == ["libonnxruntime_providers_cuda.so: not found: libcublasLt.so.13"]
    found = problems(*facts(ort__provider_unresolved=[DRIVER_SONAME]), 13, True)
    assert f"libonnxruntime_providers_cuda.so: not found: {DRIVER_SONAME}" in found


def test_on_a_gpu_host_a_silent_cpu_fallback_fails():
    torch, ort = facts(torch__device_ok=True, ort__session_providers=["CPUExecutionProvider"])
    assert problems(torch, ort, 13, True) == [
        "an onnxruntime session asked for CUDA runs on ['CPUExecutionProvider']"]
    torch, ort = facts(torch__device_ok=False, ort__session_providers=["CUDAExecutionProvider",
                                                                         "CPUExecutionProvider"])
    assert problems(torch, ort, 13, True) == ["torch sees no CUDA device"]


def test_a_probe_that_crashes_is_reported_not_raised():
    found = problems("ImportError: libtorch_cuda.so", "ModuleNotFoundError: No module named 'onnxruntime'", 13, False)
    assert found == ["torch probe failed: ImportError: libtorch_cuda.so",
                     "onnxruntime probe failed: ModuleNotFoundError: No module named 'onnxruntime'"]


def test_the_real_script_fails_loudly_on_a_stack_it_was_not_asked_for():
    # a CUDA major no build has: fails on any host, with or without a GPU or CUDA builds
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "check_cuda.py"), "--cuda-major", "99"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines and all(line.startswith("check_cuda: FAIL: ") for line in lines)
    assert "no library list for CUDA 99" in lines[-1]
    assert "check_cuda: ok" not in done.stdout

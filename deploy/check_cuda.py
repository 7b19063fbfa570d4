"""Check that torch and onnxruntime in this environment are one CUDA stack that loads.

    python deploy/check_cuda.py            # libraries only, no GPU needed (the image build runs it)
    python deploy/check_cuda.py --device   # on a GPU host: also computes on the card with both

Facts come from fresh interpreters, one per library: torch preloads its CUDA libraries into
the process, which would hide a library that onnxruntime alone (the detect service imports no
torch) cannot find. Exit 0 when every check passes, else 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

# torch 2.13.0 and onnxruntime-gpu >= 1.28 from PyPI, and the image's base (deploy/Dockerfile).
DEFAULT_CUDA_MAJOR = 13
# The shared libraries onnxruntime's CUDA provider opens, by CUDA major: linked (cudart,
# cuBLAS, cuRAND) or opened when first needed (cuFFT, cuDNN).
CUDA_SONAMES = {
    12: ["libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcurand.so.10",
         "libcufft.so.11", "libcudnn.so.9"],
    13: ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10",
         "libcufft.so.12", "libcudnn.so.9"],
}
# Comes with the host's driver: the NVIDIA container toolkit mounts it at run time.
DRIVER_SONAME = "libcuda.so.1"

TORCH_PROBE = r"""
import json, sys
import torch
facts = {"version": torch.__version__, "cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version() if torch.version.cuda else None}
if "--device" in sys.argv:
    facts["device_ok"] = bool(torch.cuda.is_available())
    if facts["device_ok"]:
        x = torch.ones(64, 64, device="cuda")
        facts["device_sum"] = float((x @ x).sum().item())
print(json.dumps(facts))
"""

ORT_PROBE = r"""
import ctypes, json, os, subprocess, sys
import onnxruntime as ort
from onnxruntime.capi import build_and_package_info as info
sonames = json.loads(sys.argv[1])
capi = os.path.dirname(info.__file__)
facts = {"version": ort.__version__, "cuda": getattr(info, "cuda_version", None),
         "providers": ort.get_available_providers(), "sonames": {}}
for name in sonames:
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        facts["sonames"][name] = None
    except OSError as e:
        facts["sonames"][name] = str(e)
provider = os.path.join(capi, "libonnxruntime_providers_cuda.so")
facts["provider_present"] = os.path.exists(provider)
if facts["provider_present"]:
    ldd = subprocess.run(["ldd", provider], capture_output=True, text=True)
    facts["provider_unresolved"] = sorted(
        line.split()[0] for line in ldd.stdout.splitlines() if "not found" in line)
if "--device" in sys.argv:
    from onnx import TensorProto, helper
    node = helper.make_node("Add", ["x", "x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    facts["session_providers"] = sess.get_providers()
print(json.dumps(facts))
"""


def probe(code: str, *args: str) -> dict | str:
    """The facts one fresh interpreter reports, or what went wrong running it."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return " / ".join(tail) or f"exit {done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def major(version: str | None) -> int | None:
    return int(version.split(".")[0]) if version else None


def problems(torch: dict | str, ort: dict | str, cuda_major: int, device: bool) -> list[str]:
    """Everything that keeps the two libraries from being one working CUDA stack."""
    found: list[str] = []
    if isinstance(torch, str):
        found.append(f"torch probe failed: {torch}")
    elif major(torch["cuda"]) is None:
        found.append(f"torch {torch['version']} is a CPU build (no CUDA)")
    elif major(torch["cuda"]) != cuda_major:
        found.append(f"torch {torch['version']} is built for CUDA {torch['cuda']}, expected {cuda_major}.x")
    elif not torch["cudnn"]:
        found.append(f"torch {torch['version']} cannot load cuDNN")
    if isinstance(ort, str):
        found.append(f"onnxruntime probe failed: {ort}")
        return found
    if "CUDAExecutionProvider" not in ort["providers"]:
        found.append(f"onnxruntime {ort['version']} has no CUDAExecutionProvider "
                     f"(providers: {', '.join(ort['providers'])}): the CPU wheel, or installed over the GPU one")
        return found
    if major(ort["cuda"]) != cuda_major:
        found.append(f"onnxruntime {ort['version']} is built for CUDA {ort['cuda']}, expected {cuda_major}.x")
    for name, error in ort["sonames"].items():
        if error:
            found.append(f"onnxruntime's CUDA provider needs {name}, which does not load: {error}")
    if not ort["provider_present"]:
        found.append("onnxruntime's libonnxruntime_providers_cuda.so is missing")
    else:
        missing = [n for n in ort["provider_unresolved"] if device or n != DRIVER_SONAME]
        if missing:
            found.append(f"libonnxruntime_providers_cuda.so: not found: {', '.join(missing)}")
    if device:
        if not isinstance(torch, str) and not torch.get("device_ok"):
            found.append("torch sees no CUDA device")
        if ort.get("session_providers", [None])[0] != "CUDAExecutionProvider":
            found.append(f"an onnxruntime session asked for CUDA runs on {ort.get('session_providers')}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="store_true", help="also compute on the GPU (needs one)")
    parser.add_argument("--cuda-major", type=int, default=DEFAULT_CUDA_MAJOR, help="the CUDA major both must use")
    args = parser.parse_args(argv)
    flags = ["--device"] if args.device else []
    sonames = CUDA_SONAMES.get(args.cuda_major, [])
    torch = probe(TORCH_PROBE, *flags)
    ort = probe(ORT_PROBE, json.dumps(sonames), *flags)
    found = problems(torch, ort, args.cuda_major, args.device)
    if not sonames:
        found.append(f"no library list for CUDA {args.cuda_major} (known: {sorted(CUDA_SONAMES)})")
    for line in found:
        print(f"check_cuda: FAIL: {line}", file=sys.stderr)
    if not found:
        print(f"check_cuda: ok: torch {torch['version']} (CUDA {torch['cuda']}, cuDNN {torch['cudnn']}), "
              f"onnxruntime {ort['version']} (CUDA {ort['cuda']}), "
              f"{'computed on the GPU' if args.device else 'libraries load'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

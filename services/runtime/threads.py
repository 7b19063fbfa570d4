"""Apply the supervisor's thread plan to the libraries a service uses.

The supervisor sets OMP/MKL/OPENBLAS variables; these calls cover what reads no
variable (OpenCV, torch's pools, onnxruntime sessions).
"""

from __future__ import annotations

import os
import sys


def planned_threads() -> int:
    try:
        return max(1, int(os.environ.get("ONECARD_SERVICE_THREADS", "0")))
    except ValueError:
        return 1


def apply_threads(n: int) -> None:
    try:
        import cv2
        cv2.setNumThreads(n)
    except ImportError:
        pass
    if "torch" in sys.modules:
        import torch
        torch.set_num_threads(n)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set once in this process


def ort_session_options(n: int):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = n
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return opts

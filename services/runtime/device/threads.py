"""Apply the supervisor's thread plan to the libraries a service uses, so that they hold
up when the CPU is shared.

The supervisor plans N threads per service from the container's CPU quota and sets
OMP/MKL/OPENBLAS variables; these calls cover what reads no variable (OpenCV, torch's
pools, onnxruntime sessions). Under contention the cost is not the thread count alone
but spinning: OpenMP and onnxruntime workers busy-wait between parallel regions, and
with a neighbour on the same cores a 40-step diffusion on CPU ran 20x slower. So waits
are passive (``OMP_WAIT_POLICY=PASSIVE``, onnxruntime's ``allow_spinning = 0``), torch's
inter-op pool has one thread, and onnxruntime runs sequentially.
"""

from __future__ import annotations

import os
import sys

# Set before any OpenMP runtime loads (serve.py applies them first thing); a value
# the operator set in the service's env wins.
PASSIVE_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "GOMP_SPINCOUNT": "0"}


def set_passive_waits(environ: dict | None = None) -> None:
    env = os.environ if environ is None else environ
    for key, value in PASSIVE_WAIT_ENV.items():
        env.setdefault(key, value)


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
    """Session options for the planned threads, with passive waits and no CPU arena: the arena
    keeps the peak of the biggest call for the life of the process (one 16-image call at
    1024x1024 held 10 GB), and its shrinkage option hands that back only at the next call, so
    an idle service kept +275 MiB after a burst. Without it, big tensors are their own
    mappings (shell/process.py fixes glibc's threshold), given back as they are freed. Same
    speed as the arena with shrinkage (2 threads, medians of 7: face detector 640 px 88-113
    against 89-110 ms, style transfer 256 px 29.4 against 28.9 ms, 1024 px 425 against
    410 ms). The CUDA provider's arena is not this one."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = n
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.enable_cpu_mem_arena = False
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


def ort_run_options():
    """Run options for sessions made with ort_session_options. (They have no CPU arena, so
    there is no arena shrinkage to ask for: onnxruntime refuses it for an arena it lacks.)"""
    import onnxruntime as ort
    return ort.RunOptions()


WORKER_NICENESS = 10  # decode/encode and model threads yield the CPU to the event loop and the probes
LOOP_NICENESS = -5    # the event loop ahead of other processes' threads, where the OS allows it


def raise_loop_priority(niceness: int = LOOP_NICENESS) -> bool:
    """Run the calling thread (the event loop's) at `niceness`, where the OS allows it (root
    with CAP_SYS_NICE, or an RLIMIT_NICE that reaches it); else it stays as it is. Its cores
    saturated by another process's threads (32 clients sending requests and hanging up, from
    the same 2 cores), the loop had a thirty-third of the CPU: detect's /healthz p99 was 81 ms,
    19 ms at -5. Threads it starts later inherit it (the workers then lower theirs from there).
    Whether it took."""
    try:
        import threading
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) > niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        return True
    except (AttributeError, OSError):
        return False


def lower_priority(increment: int = WORKER_NICENESS) -> None:
    """Run the calling thread at a lower priority (Linux nice is per thread). On a small
    machine busy decoding, the event loop that answers /healthz and moves bytes then gets a
    core when it needs one, instead of queueing behind the work; the work still gets every
    core the loop does not need. Threads the caller starts later (a model's own pools)
    inherit it. Raising one's own niceness needs no privilege; failure changes nothing."""
    try:
        import threading
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (AttributeError, OSError):
        pass

"""Shared bits of the benchmarks: images, the service process, result files, tables."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

from tests.images import astronaut, coffee, encode, group_photo_jpeg  # noqa: E402
from tests.service_harness import ServiceProcess  # noqa: E402


def bench_images() -> list[tuple[bytes, str]]:
    return [(encode(astronaut()), "image/png"), (group_photo_jpeg(), "image/jpeg"), (encode(coffee()), "image/png")]


def pct(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))]


def timed_loop(fn: Callable[[int], Any], duration_s: float, min_runs: int = 5) -> list[float]:
    """Call fn(i) until duration_s has passed (at least min_runs times); the latencies."""
    out = []
    t_end = time.perf_counter() + duration_s
    i = 0
    while time.perf_counter() < t_end or i < min_runs:
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
        i += 1
    return out


def service(app: str, settings: dict, threads: int = 1, env: dict | None = None) -> ServiceProcess:
    tmp = Path(tempfile.mkdtemp(prefix="onecard-bench-"))
    return ServiceProcess(app, settings, tmp, threads=threads, env=env)


def gpu_name() -> str | None:
    """The first card as NVML names it, with its memory and driver; None without one."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            return f"{name} ({mem >> 20} MiB, driver {pynvml.nvmlSystemGetDriverVersion()})"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library, no card
        return None


def write_result(name: str, doc: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    gpu = gpu_name()
    doc = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
           "when": time.strftime("%Y-%m-%dT%H:%M:%S"), **({"gpu": gpu} if gpu else {}), **doc}
    path.write_text(json.dumps(doc, indent=2))
    return path


def table(rows: list[tuple], header: tuple) -> str:
    cols = list(zip(header, *rows, strict=False))
    widths = [max(len(str(v)) for v in col) for col in cols]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(header, widths, strict=False))]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=False)) for r in rows]
    return "\n".join(lines)


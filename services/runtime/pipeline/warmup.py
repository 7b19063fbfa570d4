"""Warm-up: real inferences before the service says ready, and the cost curves measured on them.

First the backend's warm-up items run ``warmup_runs`` times (the first calls of a model are
slow: kernels compile, arenas grow). Then the batch-time curve: the same items, repeated to
batches of 1, 2, 4 ... ``max_batch_size``, each size timed twice (the faster run counts:
noise only ever adds time) with the peak memory each call adds. A model that cannot batch
is timed at 1.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common import hostmemory as memory
from services.runtime.pipeline.backend import is_out_of_memory
from services.runtime.pipeline.cost import ServiceCost

log = logging.getLogger("onecard.service")


def batch_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


class PeakProbe:
    """The peak memory one model call adds: torch's allocator on CUDA, the process's VmHWM
    on the CPU; None where neither says anything true (onnxruntime on a GPU)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._base = 0

    @classmethod
    def for_backend(cls, backend: Any) -> PeakProbe:
        device = str(getattr(backend, "device", None) or "cpu")
        if device == "cuda":
            torch = sys.modules.get("torch")
            if getattr(backend, "uses_torch", False) and torch is not None and torch.cuda.is_available():
                return cls("torch")
            return cls("none")
        return cls("host")

    @property
    def precise(self) -> bool:
        """Whether a live call's figure is its own (the host figure includes other threads)."""
        return self.kind == "torch"

    def start(self) -> None:
        if self.kind == "torch":
            torch = sys.modules["torch"]
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        elif self.kind == "host":
            self._base = memory.resident_bytes() or 0
            if not memory.reset_peak():
                self.kind = "none"

    def held_bytes(self) -> int | None:
        """What the model holds on the card between calls (torch's allocations; None where
        unknown). Not torch's reserved memory: after warm-up that is mostly its cache of
        freed blocks, which the next call reuses."""
        if self.kind == "torch":
            return int(sys.modules["torch"].cuda.memory_allocated())
        return None

    def stop(self) -> int | None:
        if self.kind == "torch":
            return max(0, sys.modules["torch"].cuda.max_memory_allocated() - self._base)
        if self.kind == "host":
            peak = memory.peak_bytes()
            return None if peak is None else max(0, peak - self._base)
        return None


def measured_call(fn: Callable[[list], list], items: list, probe: PeakProbe | None) -> tuple[list, float, int | None]:
    """Run one model call on the calling thread: (results, seconds, peak bytes added)."""
    if probe is not None:
        probe.start()
    t0 = time.perf_counter()
    results = fn(items)
    seconds = time.perf_counter() - t0
    return results, seconds, (probe.stop() if probe is not None else None)


class WarmUpFailed(RuntimeError):
    """A warm-up item failed alone (its error returned as its result): ``failure``."""

    def __init__(self, failure: BaseException):
        super().__init__(f"warm-up inference failed: {failure!r}")
        self.failure = failure


def _check(results: list) -> None:
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise WarmUpFailed(failed[0])


async def _out_of_memory(exc: BaseException, backend: Any, size: int, run_on_worker: Callable) -> bool:
    """True (and the memory freed, on the worker: it is GPU work, and a full collection) when
    a warm-up call of `size` items ran out of memory."""
    if not is_out_of_memory(exc.failure if isinstance(exc, WarmUpFailed) else exc):  # its type, not its repr
        return False
    log.warning("warm-up: a call of %d item(s) ran out of memory (%s); larger batches are not run", size,
                str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__)
    try:
        await run_on_worker(backend.on_out_of_memory, tracked=False)
    except Exception:  # noqa: BLE001 - the next call says whether memory came back
        log.exception("freeing memory after out-of-memory failed")
    return True


@dataclass
class WarmUp:
    inferences: int = 0
    max_batch: int = 1      # the largest batch that ran; a bigger one ran out of memory or was not tried


async def warm_up(backend: Any, run_on_worker: Callable, cost: ServiceCost, runs: int, max_batch: int) -> WarmUp:
    """Warm the model and measure its curves. A batch size that runs out of memory (a GPU
    budget smaller than ``max_batch_size`` items need) ends the climb: the service then
    serves batches up to the last size that ran, instead of failing every full batch later
    (or not starting at all)."""
    items = list(backend.warmup_items())
    out = WarmUp(max_batch=max_batch)
    if not items or runs <= 0:
        return out
    for _ in range(runs):
        try:
            _check(await run_on_worker(backend.infer_batch, items))
        except Exception as exc:
            if len(items) == 1 or not await _out_of_memory(exc, backend, len(items), run_on_worker):
                raise
            items = items[:1]
            _check(await run_on_worker(backend.infer_batch, items))
        out.inferences += len(items)
    cost.reference_work = sum(cost.item_work(i) for i in items) / len(items)
    probe = PeakProbe.for_backend(backend)
    samples: list[tuple[int, int]] = []
    fitted = 1
    for size in batch_sizes(max_batch):
        batch = [items[i % len(items)] for i in range(size)]
        best = None
        peak_max = None
        try:
            for _ in range(2):
                results, seconds, peak = await run_on_worker(measured_call, backend.infer_batch, batch, probe)
                _check(results)
                out.inferences += size
                best = seconds if best is None else min(best, seconds)
                if peak is not None:
                    peak_max = peak if peak_max is None else max(peak_max, peak)
        except Exception as exc:
            if size == 1 or not await _out_of_memory(exc, backend, size, run_on_worker):
                raise
            break
        fitted = size
        cost.curve.replace(size, best / cost.work_ratio(batch))
        if peak_max is not None:
            samples.append((sum(cost.item_pixels(i) for i in batch), peak_max))
    out.max_batch = fitted
    if samples:
        cost.memory.fit(samples)
    cost.probe = probe
    await run_on_worker(memory.trim_heap, tracked=False)  # malloc_trim: tens of ms, never on the loop
    log.info("cost model: %s", {"time": cost.curve.snapshot(), "memory": cost.memory.snapshot()})
    return out

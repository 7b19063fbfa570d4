"""What a model call costs, in time and in memory: one model, learned from the model itself.

Time: a batch of b items takes ``seconds(b)``, measured during warm-up at 1, 2, 4 ... and
``max_batch_size`` items with real inputs, and kept current from every live call (an
exponentially weighted mean per size). Items do not all weigh the same (a 1024x1024
picture is four 512x512 ones; 40 diffusion steps are twice 20): a backend says what an
item weighs (``Backend.item_work``) and the curve is kept per unit of the warm-up item's
work. An accelerator runs 8 items in far less than 8 times one (H100, SD-1.5 img2img:
0.643 s for 1, 1.094 s for 8); a CPU model runs them in about 8 times one.

Memory: the peak a call adds is ``fixed + per_pixel x pixels in the batch`` (pixels as the
model sees them, ``Backend.item_pixels``), fitted from the warm-up calls' measured peaks
(the process's VmHWM, reset before each call, on the CPU; torch's peak allocation on
CUDA) and raised whenever a live call peaks higher than foreseen. A backend may state a
floor (``Backend.memory_per_pixel``) for devices where nothing can be measured.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

EWMA_ALPHA = 0.2
CURVE_WEIGHT_CAP = 20  # calls beyond this do not make a size's mean more certain (it is an EWMA)
MEMORY_MARGIN = 1.25  # measured peaks vary with allocator chunking: plan above them


class BatchCurve:
    """Seconds per model call by batch size, per unit of reference work."""

    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self._points: dict[int, float] = {}
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def observe(self, size: int, seconds: float) -> None:
        if size < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            old = self._points.get(size)
            self._points[size] = seconds if old is None else old + EWMA_ALPHA * (seconds - old)
            self._counts[size] = self._counts.get(size, 0) + 1

    def replace(self, size: int, seconds: float) -> None:
        """A warm-up measurement: the value, not one more sample of a mean."""
        with self._lock:
            self._points[size] = seconds
            self._counts[size] = max(1, self._counts.get(size, 0))

    @property
    def known(self) -> bool:
        return bool(self._points)

    def _monotone(self) -> list[tuple[int, float]]:
        """Measured points, made non-decreasing in size: a bigger batch never costs less
        (a noisy sample must not make the scheduler wait for a "cheaper" bigger batch).

        Weighted isotonic regression (pool adjacent violators), each size weighted by its
        calls: one slow call of a rare size (a batch of 7 that met an allocator growth, seen
        once on an H200 at 1.47 s beside 1.16 s for 8) is pooled with its neighbours instead
        of lifting every bigger size to it, which made two calls of 4 look cheaper than one
        of 8 and split 8 clients into two halves for good."""
        with self._lock:
            points = sorted(self._points.items())
            counts = dict(self._counts)
        blocks: list[list[float]] = []        # [mean seconds, weight, number of sizes]
        for size, secs in points:
            blocks.append([secs, float(min(max(1, counts.get(size, 1)), CURVE_WEIGHT_CAP)), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
                blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
        out: list[tuple[int, float]] = []
        sizes = iter(size for size, _ in points)
        for mean, _, n in blocks:
            out.extend((next(sizes), mean) for _ in range(n))
        return out

    def seconds(self, size: int) -> float | None:
        """Predicted seconds for `size` items of reference work; None before any measurement.
        Between measured sizes: linear. Beyond the largest: its own per-item cost, so an
        unmeasured bigger batch never looks like a bargain."""
        points = self._monotone()
        if not points:
            return None
        if size <= points[0][0]:
            s0, t0 = points[0]
            return t0 * size / s0 if s0 > 1 and size < s0 else t0
        for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False):
            if s0 <= size <= s1:
                return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
        s_last, t_last = points[-1]
        return t_last * size / s_last

    def fixed_and_marginal(self) -> tuple[float, float] | None:
        """(A, B) of the least-squares line A + B(b - 1) through the measured points."""
        points = self._monotone()
        if not points:
            return None
        if len(points) == 1:
            size, secs = points[0]
            return (secs, secs) if size == 1 else (secs / size, secs / size)
        n = len(points)
        mx = sum(s - 1 for s, _ in points) / n
        my = sum(t for _, t in points) / n
        var = sum((s - 1 - mx) ** 2 for s, _ in points)
        slope = sum((s - 1 - mx) * (t - my) for s, t in points) / var if var else 0.0
        slope = max(0.0, slope)
        return max(0.0, my - slope * mx), slope

    def snapshot(self) -> dict[str, Any]:
        fit = self.fixed_and_marginal()
        with self._lock:
            points = {str(k): round(v * 1000, 3) for k, v in sorted(self._points.items())}
            counts = {str(k): v for k, v in sorted(self._counts.items())}
        return {"ms_by_batch_size": points, "calls_by_batch_size": counts,
                "fixed_ms": None if fit is None else round(fit[0] * 1000, 3),
                "per_extra_item_ms": None if fit is None else round(fit[1] * 1000, 3)}


@dataclass
class MemoryCurve:
    """Peak bytes one model call adds: fixed + per_pixel x (pixels of its items)."""
    fixed: float = 0.0
    per_pixel: float = 0.0
    floor_per_pixel: float = 0.0            # the backend's stated minimum
    samples: list[tuple[int, int]] = field(default_factory=list)  # (pixels, peak bytes)
    measured: bool = False

    def call_bytes(self, pixels: int) -> int:
        per_pixel = max(self.per_pixel, self.floor_per_pixel)
        return int(MEMORY_MARGIN * (self.fixed + per_pixel * pixels))

    def fit(self, samples: list[tuple[int, int]]) -> None:
        """Least squares through (pixels, peak) samples, both coefficients >= 0."""
        samples = [(p, b) for p, b in samples if p >= 0 and b >= 0]
        if not samples:
            return
        self.samples = samples[-16:]
        self.measured = True
        n = len(samples)
        mx = sum(p for p, _ in samples) / n
        my = sum(b for _, b in samples) / n
        var = sum((p - mx) ** 2 for p, _ in samples)
        slope = sum((p - mx) * (b - my) for p, b in samples) / var if var else (my / mx if mx else 0.0)
        slope = max(0.0, slope)
        fixed = max(0.0, my - slope * mx)
        # the line must cover every sample (a fit below a measured peak would under-plan)
        for p, b in samples:
            if fixed + slope * p < b:
                slope = (b - fixed) / p if p else slope
                fixed = fixed if p else max(fixed, b)
        self.fixed, self.per_pixel = fixed, slope

    def observe(self, pixels: int, peak: int) -> None:
        """A live call: when it peaked above the line, the line rises to cover it."""
        if peak <= 0:
            return
        if self.fixed + max(self.per_pixel, self.floor_per_pixel) * pixels < peak:
            self.fit([*self.samples, (pixels, peak)])

    def snapshot(self) -> dict[str, Any]:
        return {"fixed_bytes": int(self.fixed), "per_pixel_bytes": round(max(self.per_pixel, self.floor_per_pixel), 1),
                "measured": self.measured, "margin": MEMORY_MARGIN}

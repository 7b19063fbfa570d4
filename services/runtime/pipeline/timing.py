"""Per-request stage durations (decode, queue, infer, encode), for Server-Timing, metrics and logs."""

from __future__ import annotations

import time


class Timing:
    """Per-request stage durations, for Server-Timing, metrics and logs."""

    STAGES = ("decode", "queue", "infer", "encode")

    def __init__(self, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.stages: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def header(self) -> str:
        return ", ".join(f"{k};dur={v * 1000:.2f}" for k, v in self.stages.items())

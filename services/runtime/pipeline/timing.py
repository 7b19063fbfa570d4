"""Per-request stage durations (decode, queue, infer, encode), for Server-Timing, metrics,
logs and, when traces are on, the request's stage spans."""

from __future__ import annotations

import time
from typing import Any

from services.runtime.traces.stages import stages_of_this_request


class Timing:
    """Per-request stage durations, for Server-Timing, metrics and logs."""

    STAGES = ("decode", "queue", "infer", "encode")

    def __init__(self, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.stages: dict[str, float] = {}
        self.trace = stages_of_this_request()  # None unless this request is traced

    def add(self, stage: str, seconds: float, end: float | None = None, traced: bool = True) -> None:
        """``seconds`` more of ``stage``, which ended at ``end`` (perf_counter; now when None)."""
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        if traced and self.trace is not None:
            end = time.perf_counter() if end is None else end
            self.trace.record(stage, end - seconds, end)

    def interval(self, stage: str, start: float, end: float, **attributes: Any) -> None:
        """A stage's span only (its time is counted with add(..., traced=False))."""
        if self.trace is not None:
            self.trace.record(stage, start, end, attributes)

    def header(self) -> str:
        return ", ".join(f"{k};dur={v * 1000:.2f}" for k, v in self.stages.items())

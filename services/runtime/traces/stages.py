"""The stages of one request as the pipeline measured them, kept for its trace.

The trace middleware opens a ``RequestStages`` for every traced request; the pipeline's
Timing finds it through a context variable (the request's handler runs in the middleware's
task) and records each stage's interval there. The spans are made from it once the answer
is sent, so the pipeline never touches opentelemetry. Without traces the variable is unset
and nothing is recorded.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

current_stages: ContextVar[RequestStages | None] = ContextVar("onecard_request_stages", default=None)


class RequestStages:
    __slots__ = ("intervals",)

    def __init__(self) -> None:
        # (stage, start, end, attributes), times from time.perf_counter()
        self.intervals: list[tuple[str, float, float, dict[str, Any]]] = []

    def record(self, stage: str, start: float, end: float, attributes: dict[str, Any] | None = None) -> None:
        self.intervals.append((stage, start, end, attributes or {}))


def stages_of_this_request() -> RequestStages | None:
    return current_stages.get()

"""Submits admitted against a memory bound before their bodies are read.

A submit holds its body, the parsed document and the body re-encoded for the service at
once: about three times its size. Each one takes that much of ``submit_memory_bytes``
when its headers arrive (its Content-Length, or max_body_bytes when it sends none), and a
submit that does not fit gets 503 at once, before a byte of its body is read: 200
concurrent 30 MB submits cannot hold 200 bodies.
"""

from __future__ import annotations

from services.runtime.errors import ApiError

HELD_PER_BODY_BYTE = 3


class SubmitBudget:
    def __init__(self, total: int, retry_after_s: int):
        self.total, self.retry_after_s = total, retry_after_s
        self.used = 0

    def cost(self, content_length: str | None, max_body_bytes: int) -> int:
        declared = int(content_length) if content_length is not None and content_length.strip().isdigit() else None
        size = min(declared, max_body_bytes) if declared is not None else max_body_bytes
        return min(self.total, HELD_PER_BODY_BYTE * max(size, 1))

    def take(self, n: int) -> Held:
        if self.used + n > self.total:
            raise ApiError(503, "busy", f"submits being read hold {self.used} of submit_memory_bytes "
                           f"({self.total}); this one needs {n}; retry shortly",
                           {"Retry-After": str(self.retry_after_s or 1), "Connection": "close"})
        self.used += n
        return Held(self, n)


class Held:
    def __init__(self, budget: SubmitBudget, n: int):
        self.budget, self.n = budget, n

    def release(self) -> None:
        self.budget.used -= self.n
        self.n = 0

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

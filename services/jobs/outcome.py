"""What a local service's answer means for the job: the policy, as a table.

| answer                                   | verdict       | the job                                   |
| ---------------------------------------- | ------------- | ----------------------------------------- |
| 2xx                                      | SUCCEEDED     | result stored                             |
| 503 overloaded / not_ready, 429          | BACKPRESSURE  | kept, retried after Retry-After; not an attempt |
| other 4xx                                | REJECTED      | failed for good: the job itself is wrong  |
| 5xx (500, 502, 503 out_of_memory, 504)   | ATTEMPT_FAILED| re-queued until max_attempts, then dead-lettered |
| no answer (connection refused, reset, timeout) | ATTEMPT_FAILED | same, and the service is checked before more jobs go to it |
"""

from __future__ import annotations

import enum

BACKPRESSURE_CODES = frozenset({"overloaded", "not_ready", "queue_full"})
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 0.05, 30.0


class Verdict(enum.Enum):
    SUCCEEDED = "succeeded"
    BACKPRESSURE = "backpressure"
    REJECTED = "rejected"
    ATTEMPT_FAILED = "attempt_failed"


def classify(status: int, error_code: str | None) -> Verdict:
    if 200 <= status < 300:
        return Verdict.SUCCEEDED
    if status == 429 or (status == 503 and error_code in BACKPRESSURE_CODES):
        return Verdict.BACKPRESSURE
    if 400 <= status < 500:
        return Verdict.REJECTED
    return Verdict.ATTEMPT_FAILED


def retry_after_s(header: str | None, default: float = 1.0) -> float:
    """Seconds to wait from a Retry-After header (delta-seconds only), clamped."""
    try:
        value = float(header) if header is not None else default
    except ValueError:
        value = default
    if value != value:  # NaN
        value = default
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, value))

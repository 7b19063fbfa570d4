"""The one place that decides what happens to a job after a run: succeeded, failed for good,
retried (after a backoff with jitter) or dead-lettered. Both queue backends and the consumer
ask this module; the Redis scripts only carry out what it decided.

What a local service's answer means:

| answer                                          | verdict        | the job                                     |
| ----------------------------------------------- | -------------- | ------------------------------------------- |
| 2xx                                             | SUCCEEDED      | result stored                               |
| 503 overloaded / not_ready / queue_full, 429    | BACKPRESSURE   | held, tried again after Retry-After; not an attempt |
| other 4xx                                       | REJECTED       | failed for good: the job itself is wrong    |
| 5xx (500, 502, 503 out_of_memory, 504), timeout | ATTEMPT_FAILED | an attempt: retried after a backoff, dead-lettered once max_attempts are spent |
| connection refused (the request never left)     | NOT_SENT       | not an attempt: sent again once the service is up |
| connection reset mid-call (the service crashed) | CRASHED        | an attempt only when the job ran alone; otherwise every job that was in flight is run again, one at a time |

Attempts count runs the job is to blame for. A crash while several jobs were in flight
cannot be pinned on one of them, so none is charged: each is run again alone, and only a
job that crashes the service running alone is charged (and, once its attempts are spent,
dead-lettered). A unit that vanished mid-run (its lease expired) is treated the same way.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Decision:
    """What to do with a job whose run did not finish it."""
    action: str            # "retry" (back on the queue after delay_s) or "dead" (failed, dead-lettered)
    attempts: int          # the job's charged attempts after this run
    delay_s: float = 0.0


@dataclass
class RetryPolicy:
    """max_attempts charged runs; between them a backoff of base * 2^(n-1), capped, with
    jitter: the delay is drawn from [d * (1 - jitter), d], so that jobs that failed together
    (a service restart) do not all come back at the same moment."""
    max_attempts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    jitter: float = 0.5
    rng: Callable[[], float] = field(default=random.random, repr=False)

    def backoff(self, attempts: int) -> float:
        """The delay before the run that follows ``attempts`` charged ones."""
        if attempts <= 0 or self.backoff_s <= 0:
            return 0.0
        base = min(self.backoff_max_s, self.backoff_s * 2 ** min(attempts - 1, 30))
        return base * (1.0 - self.jitter * self.rng())

    def exhausted(self, attempts: int) -> bool:
        return attempts >= self.max_attempts

    def after_run(self, attempts_before: int, charged: bool) -> Decision:
        """A run ended without finishing the job. ``charged``: the job is to blame (a 5xx, a
        timeout, a crash while it ran alone). Not charged (backpressure, a drain, a crash
        among several): it goes back at once, its attempts unchanged."""
        if not charged:
            return Decision("retry", attempts_before, 0.0)
        attempts = attempts_before + 1
        if self.exhausted(attempts):
            return Decision("dead", attempts)
        return Decision("retry", attempts, self.backoff(attempts))

    @classmethod
    def from_settings(cls, queue) -> RetryPolicy:
        return cls(queue.max_attempts, queue.retry_backoff_s, queue.retry_backoff_max_s, queue.retry_jitter)

"""What the embedded queue may keep in the jobs service's own memory.

Without Redis, queued bodies (``queue.max_queued_bytes``) and finished results
(``queue.max_results_bytes``) live in the jobs process: 1 GiB each by default, whatever its
memory budget. Twenty-four upscale jobs with 54 MB answers and 45 queued 27 MB submits took
it to 1951 MiB against a planned 1638 MiB. When those two are left at their defaults they are
sized from the service's budget (the supervisor's plan, else a share of the container's
limit): together at most EMBEDDED_STORE_SHARE of it, less what submits being read may hold.
A value set in the configuration wins and the other is sized from what it leaves; a warning
says when they do not fit (or when the smallest that works, one result and one body, does not).
"""

from __future__ import annotations

import logging
import os

from common.hostmemory import mib, service_memory
from services.jobs.settings import JobsSettings, QueueSettings

log = logging.getLogger("onecard.jobs")
# the rest: submits being read and checked (submit_memory_bytes, taken off this share too),
# results being sent, the interpreter and its heap
EMBEDDED_STORE_SHARE = 0.6
STORE_KEYS = ("max_queued_bytes", "max_results_bytes")


def sized_for_memory(settings: JobsSettings, environ=os.environ, limit: int | None = None) -> QueueSettings:
    queue = settings.queue
    budget, source = service_memory(None, None, environ, limit)
    if budget is None:
        return queue
    room = int(budget * EMBEDDED_STORE_SHARE) - settings.submit_memory_bytes
    if queue.max_queued_bytes + queue.max_results_bytes <= room:
        return queue
    explicit = set(STORE_KEYS) & queue.model_fields_set
    left = [key for key in STORE_KEYS if key not in explicit]
    # the smallest that still works: one result of max_result_bytes, one submit's body
    floors = {"max_queued_bytes": settings.max_body_bytes, "max_results_bytes": settings.max_result_bytes}
    share = (room - sum(getattr(queue, key) for key in explicit)) // max(1, len(left))
    sized = queue.model_copy(update={key: max(floors[key], share) for key in left})
    if sized.max_queued_bytes + sized.max_results_bytes > room:
        log.warning("jobs: the embedded queue holds up to %s of bodies and results, over %g of the service's "
                    "memory budget (%s, %s) less submit_memory_bytes (%s)%s",
                    mib(sized.max_queued_bytes + sized.max_results_bytes), EMBEDDED_STORE_SHARE, mib(budget), source,
                    mib(settings.submit_memory_bytes),
                    "; as configured" if explicit else ": its smallest (one result, one submit's body)")
    return sized

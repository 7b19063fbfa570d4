"""What the embedded queue may keep in the jobs service's own memory.

Without Redis, queued bodies (``queue.max_queued_bytes``) and finished results
(``queue.max_results_bytes``) live in the jobs process: 1 GiB each by default, whatever its
memory budget. Twenty-four upscale jobs with 54 MB answers and 45 queued 27 MB submits took
it to 1951 MiB against a planned 1638 MiB. When those two are left at their defaults they are
sized from the service's budget (the supervisor's plan, else a share of the container's
limit): together at most EMBEDDED_STORE_SHARE of it, less what submits being read may hold.
Values set in the configuration win (a warning says when they do not fit).
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
    if set(STORE_KEYS) & queue.model_fields_set:
        log.warning("jobs: queue.max_queued_bytes and queue.max_results_bytes (%s together) are over %g of the "
                    "service's memory budget (%s, %s) less submit_memory_bytes; kept as configured",
                    mib(queue.max_queued_bytes + queue.max_results_bytes), EMBEDDED_STORE_SHARE, mib(budget), source)
        return queue
    results = max(settings.max_result_bytes, room // 2)   # at least one result fits
    queued = max(settings.max_body_bytes, room - results)  # and one submit's body
    return queue.model_copy(update={"max_queued_bytes": queued, "max_results_bytes": results})

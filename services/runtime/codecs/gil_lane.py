"""One CPU-pool thread at a time for work that keeps the GIL.

Decoders, encoders and models release the GIL and run side by side on the cores. Parsing
JSON, base64 and multipart does not: only one thread can run it at a time anyway, and every
such thread competes with the event loop for the GIL. With four of them the loop lost the
race again and again (a 5 ms sleep overshot by 126 ms at p99 beside four threads parsing
20 MB JSON bodies; 18 ms when they took turns through this lane). So those steps queue here,
in small slices: the lane costs no throughput (they could not run together) and the loop
competes with one thread at most.

Never taken on the event loop: `lane()` is for the CPU pool's threads.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from services.runtime.codecs.page_release import hand_back_pages

T = TypeVar("T")

# work on fewer bytes than this is too short to matter (and may run on the loop itself)
LANE_MIN_BYTES = 64 * 1024

_LANE = threading.RLock()   # reentrant: a step in the lane may call another


def lane() -> threading.RLock:
    return _LANE


def in_lane(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), in the lane when it works on `size` bytes or more."""
    if size < LANE_MIN_BYTES:
        return fn(*args, **kwargs)
    with _LANE:
        return fn(*args, **kwargs)


def release_on(executor: concurrent.futures.Executor, garbage: list) -> None:
    """Empty `garbage` on one of `executor`'s threads, in the lane: freeing big objects hands
    their pages back to the system (munmap, 1.3 ms a 20 MB object), which the event loop
    should not spend; their pages go first, with the GIL released (page_release). The
    caller keeps no other reference."""
    try:
        executor.submit(release_here, garbage)
    except RuntimeError:  # shut down: here then
        garbage.clear()


def release_here(garbage: list) -> None:
    """Empty `garbage` on the calling thread (a CPU-pool thread): its big buffers hand back
    their pages first, then the objects are freed in the lane."""
    hand_back_pages(garbage)   # the pages first, with the GIL released: the munmap then has none to free
    with _LANE:
        garbage.clear()

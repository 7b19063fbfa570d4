"""The bounded executor for decode, encode, base64 and other CPU work: the event loop only
moves bytes and awaits."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from services.runtime.codecs.gil_lane import release_on
from services.runtime.device.threads import lower_priority
from services.runtime.pipeline.contained import contained


def cpu_pool_size(threads: int) -> int:
    """More decode/encode threads than cores: one request's big picture then holds one thread
    while the others serve small ones (the decoders release the GIL, so the kernel shares the
    cores between them), and what they may hold together is bounded by the memory ledger."""
    return min(32, max(4, 2 * threads))


class CpuPool:
    def __init__(self, threads: int):
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="onecard-cpu",
                                                           initializer=lower_priority)

    async def run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, contained, fn, *args)

    def release(self, garbage: list) -> None:
        """Let a request's big objects go on a worker, in the GIL lane, instead of on the event
        loop: freeing them hands their pages back to the system (munmap, tens of MB a request),
        and after one batch of eight 20 MB JSON uploads the loop spent 40-80 ms doing it in a
        row while the probes waited. The caller keeps no other reference."""
        release_on(self._pool, garbage)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

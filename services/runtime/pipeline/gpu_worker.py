"""The one thread every model call runs on, and how a waiting request notices its client left."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from services.runtime.device.threads import lower_priority
from services.runtime.pipeline.contained import contained


class GpuWorker:
    """One thread for every model call; knows how long the current call has been running."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onecard-gpu",
                                                           initializer=lower_priority)
        self._busy_since: float | None = None

    async def run(self, fn: Callable, *args: Any, tracked: bool = True) -> Any:
        """Run on the worker thread; `tracked` calls count towards a stuck worker (not loading)."""
        loop = asyncio.get_running_loop()
        if tracked:
            return await loop.run_in_executor(self._pool, self._call, fn, args)
        return await loop.run_in_executor(self._pool, contained, fn, *args)

    def _call(self, fn: Callable, args: tuple) -> Any:
        self._busy_since = time.monotonic()
        try:
            return contained(fn, *args)
        finally:
            self._busy_since = None

    def busy_for(self) -> float:
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def wait_disconnect(receive: Callable) -> None:
    """Returns when the client has gone. Only call once the body has been read."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

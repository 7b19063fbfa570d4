"""A big upload's pieces copied into the bytes object they become on one background thread,
not on the event loop.

Each piece of an upload cost the loop a copy into fresh pages, page faults included: under
sixteen 20 MB uploads that was a quarter of the loop's work, and a probe waits for every
piece handled in the few loop iterations it needs. Here the loop only reserves the piece's
place and queues it; one daemon thread copies (memmove, with the GIL released), in order.
The object is handed out once every copy is done (``await settled()``). The queue holds
pieces already received and counted, and the copier runs at memory speed, so what waits in
it is a few pieces at most.
"""

from __future__ import annotations

import asyncio
import queue
import threading

from services.runtime.codecs.fresh_bytes import GIL_FREE_COPY_BYTES, FreshBytes
from services.runtime.codecs.raw_buffers import copy_into


class _Copier:
    """One daemon thread that runs the queued copies in order (started at the first)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, owner: CopyBehind, address: int, piece: bytes) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._start_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="onecard-copier", daemon=True)
                    self._thread.start()
        self._queue.put((owner, address, piece))

    def _run(self) -> None:
        while True:
            owner, address, piece = self._queue.get()
            failed = None
            try:
                copy_into(address, piece)
            except Exception as exc:  # noqa: BLE001 -- the thread must outlive it: the next bodies wait on it
                failed = exc
            owner._copied(failed)
            del owner, piece, failed  # nothing kept alive while the queue is empty


_COPIER = _Copier()


class CopyBehind:
    """Writes into `target` (a FreshBytes), big bytes pieces by the copier thread."""

    def __init__(self, target: FreshBytes):
        self.target = target
        self._lock = threading.Lock()
        self._pending = 0
        self._in_place = 0  # while copies are queued: every byte before this offset is written
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._failed: BaseException | None = None

    @property
    def size(self) -> int:
        return self.target.size

    @property
    def capacity(self) -> int:
        return self.target.capacity

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        # only bytes are queued: nothing can change them before the copier gets to them
        if type(piece) is not bytes or len(piece) < GIL_FREE_COPY_BYTES:
            self.target.write(piece)
            return
        with self._lock:
            if self._pending == 0:  # the first hole: what is before it is in place
                self._in_place = self.target.size
            address = self.target.reserve(len(piece))
            self._pending += 1
        _COPIER.put(self, address, piece)

    def written(self) -> memoryview:
        """The bytes certainly in place: those before the first copy still queued."""
        with self._lock:
            end = self.target.size if self._pending == 0 else self._in_place
        return self.target.written()[:end]

    def _copied(self, failed: BaseException | None = None) -> None:
        with self._lock:
            if failed is not None and self._failed is None:
                self._failed = failed
            self._pending -= 1
            waiter = self._waiter if self._pending == 0 else None
            if waiter is not None:
                self._waiter = None
        if waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

    async def settled(self) -> None:
        """Returns once every queued copy is done."""
        with self._lock:
            if self._pending == 0:
                return
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._waiter = (loop, future)
        await future

    async def take(self) -> bytes:
        await self.settled()
        if self._failed is not None:  # never hand out an object with a hole in it
            raise RuntimeError("a piece of the body could not be copied") from self._failed
        return self.target.take()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)

"""The embedded queue's finished results, kept as files rather than in the process's memory.

A finished job's result stays for results_ttl_s (an hour) so that its client can fetch it:
in the process's heap, 90 img2img results kept the jobs service 376 MiB above its start
long after the clients had gone (helper-50), and a heap hands such memory back unevenly.
As files in a private directory they cost page cache, which the kernel reclaims under
pressure and reads back when a result is fetched. Every write, read and removal runs on a
worker thread, never on the event loop. A directory that cannot be made, or a write that
fails (a full or read-only disk), keeps that result in memory instead, with one warning:
no result is lost for want of disk. max_results_bytes bounds both, as before. Results kept
in memory move to the disk once it takes a write again (a later result written, or one
removed): a full disk had kept 49 results, 300 MiB, in memory until their hour was up.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import tempfile
import time

log = logging.getLogger("onecard.jobs")
PREFIX = "onecard-results-"
LOCK = ".owner"
UNLOCKED_GRACE_S = 60.0  # a directory without its lock yet may be one being made now


class ResultSpool:
    def __init__(self, directory: str | None):
        """`directory`: where the private directory is made (None: the system's temporary
        directory); "" keeps every result in memory."""
        self.dir: str | None = None
        self._lock: int | None = None
        self.in_memory: dict[str, bytes] = {}
        self.sizes: dict[str, int] = {}
        self.files: dict[str, str] = {}  # job id -> its file (a new name each time: a late removal never hits it)
        self._count = 0
        self._warned = False
        self._spilling: asyncio.Task | None = None
        if directory == "":
            return
        try:
            _remove_stale(directory or tempfile.gettempdir())
            self.dir = tempfile.mkdtemp(prefix=PREFIX, dir=directory)
            # held for this process's life: the kernel lets go of it when the process dies
            self._lock = os.open(os.path.join(self.dir, LOCK), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.close()
            self.dir = None
            self._warn(f"cannot make a directory for results in {directory or tempfile.gettempdir()} ({exc})")

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: finished jobs' results are kept in memory instead", why)

    def _new_path(self) -> str:
        assert self.dir is not None
        self._count += 1
        return os.path.join(self.dir, str(self._count))  # never a name from a request

    def size(self, job_id: str) -> int | None:
        return self.sizes.get(job_id)

    async def put(self, job_id: str, data: bytes) -> None:
        """Keep `data` as `job_id`'s result (replacing any)."""
        if self.dir is not None:
            path = self._new_path()
            try:
                await asyncio.get_running_loop().run_in_executor(None, _write, path, data)
                self.drop(job_id)  # (put twice at once: the last one written stays)
                self.files[job_id], self.sizes[job_id] = path, len(data)
                self._spill_soon()
                return
            except OSError as exc:
                self._warn(f"cannot write a result to {self.dir} ({exc.strerror or exc})")
        self.drop(job_id)
        self.in_memory[job_id] = data
        self.sizes[job_id] = len(data)

    async def chunk(self, job_id: str, start: int, size: int) -> bytes:
        """Bytes [start, start + size) of the result; b"" once it is gone."""
        if job_id in self.in_memory:
            return self.in_memory[job_id][start:start + size]
        path = self.files.get(job_id)
        if path is None:
            return b""
        return await asyncio.get_running_loop().run_in_executor(None, _read, path, start, size)

    def drop(self, job_id: str) -> None:
        """Forget the result; its file is removed on a worker thread."""
        self.in_memory.pop(job_id, None)
        self.sizes.pop(job_id, None)
        path = self.files.pop(job_id, None)
        if path is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (the broker is being torn down): at once
                _remove(path)
                return
            removed = loop.run_in_executor(None, _remove, path)
            if self.in_memory:  # room on the disk, once it is gone
                removed.add_done_callback(lambda _: self._spill_soon())

    def _spill_soon(self) -> None:
        if self.in_memory and self.dir is not None and self._spilling is None:
            self._spilling = asyncio.get_running_loop().create_task(self._spill())

    async def _spill(self) -> None:
        """Move results kept in memory to the disk, one at a time, until a write fails."""
        try:
            while self.in_memory:
                job_id, data = next(iter(self.in_memory.items()))
                path = self._new_path()
                try:
                    await asyncio.get_running_loop().run_in_executor(None, _write, path, data)
                except OSError:
                    return  # still full: the next write or removal tries again
                if self.in_memory.get(job_id) is data:  # not dropped or replaced meanwhile
                    del self.in_memory[job_id]
                    self.files[job_id] = path
                else:
                    await asyncio.get_running_loop().run_in_executor(None, _remove, path)
        finally:
            self._spilling = None

    def close(self) -> None:
        """Remove the directory and everything in it (the embedded queue dies with its process)."""
        if self._spilling is not None:
            self._spilling.cancel()
        self.in_memory.clear()
        self.sizes.clear()
        self.files.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        _remove(path)
        raise
    os.close(fd)


def _read(path: str, start: int, size: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, size, start)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_stale(parent: str) -> None:
    """The directories of jobs services that died without removing theirs (SIGKILL, OOM): no
    process holds their lock (a lock, not a process number: numbers repeat across PID
    namespaces and restarts)."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not name.startswith(PREFIX) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            if time.time() - os.stat(path).st_mtime > UNLOCKED_GRACE_S:
                shutil.rmtree(path, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)

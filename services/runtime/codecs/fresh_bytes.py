"""A ``bytes`` object (or an ASCII ``str``) of a known size filled in place, piece by piece.

Joining pieces (``b"".join``, ``bytes(bytearray)``) copies the whole result once more, with
the GIL held, and holds it twice meanwhile: 15 MB in one go for a 12 MP PNG upload, while
the probes waited. Here the object is made uninitialised (``PyBytes_FromStringAndSize(NULL,
n)``: its pages are untouched until written, so memory grows as pieces arrive), the pieces
are copied into it, and it is handed out only once every byte is written. Nothing else sees
it before, so it is as immutable to its readers as any other ``bytes``.

Big pieces are copied by ``memmove`` through ctypes, which releases the GIL for the call: the
copy, and the page faults of first writes into fresh pages, no longer hold the event loop
(a slice assignment keeps the GIL for all of it: 84 ms for 200 MB, against a 1 ms sleep
that overshot by 12 ms at most beside memmove).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from services.runtime.codecs.gil_lane import in_lane
from services.runtime.codecs.raw_buffers import bytes_address, copy_into, new_bytes, new_str, str_address

GIL_FREE_COPY_BYTES = 64 * 1024   # below this, a slice assignment is quicker than the ctypes calls


class FreshBytes:
    """Raises MemoryError when the allocator refuses the size up front (a strict overcommit
    policy may: untouched pages cost nothing otherwise)."""

    def __init__(self, size: int):
        if size < 2:  # (0 and 1 byte objects may be shared singletons)
            raise ValueError("FreshBytes is for big objects")
        self.size = 0
        self._data: bytes | str | None = self._new(size)
        self._start = self._address(self._data)
        raw = (ctypes.c_char * size).from_address(self._start)
        raw.owner = self._data  # a view of it (written()) keeps the object alive, even past take()
        self._view: memoryview | None = memoryview(raw).cast("B")

    @staticmethod
    def _new(size: int) -> bytes | str:
        return new_bytes(None, size)

    @staticmethod
    def _address(obj: bytes | str) -> int:
        return bytes_address(obj)

    @property
    def capacity(self) -> int:
        return len(self._view) if self._view is not None else 0

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        data = memoryview(piece)
        end = self._end_of(data.nbytes)
        if not data.contiguous:
            self._view[self.size:end] = data
        elif data.nbytes >= GIL_FREE_COPY_BYTES:
            copy_into(self._start + self.size, data)  # within the object: `end` was checked above
        else:
            self._view[self.size:end] = data.cast("B")
        self.size = end

    def reserve(self, n: int) -> int:
        """Room for the next `n` bytes, to be written by the caller at the address returned
        (services.runtime.codecs.copy_behind); take() still wants every byte reserved."""
        address, self.size = self._start + self.size, self._end_of(n)
        return address

    def _end_of(self, n: int) -> int:
        """Where the next `n` bytes end; ValueError when the object cannot hold them."""
        end = self.size + n
        if self._view is None or n < 0 or end > len(self._view):
            raise ValueError("more bytes than the object holds")
        return end

    def fill_from(self, fd: int) -> None:
        """Read the rest from a file descriptor, straight into the object (the kernel copies,
        with the GIL released); EOFError when it ends first."""
        import os
        if self._view is None:
            raise ValueError("taken already")
        while self.size < len(self._view):
            n = os.readv(fd, [self._view[self.size:]])
            if n == 0:
                raise EOFError(f"{len(self._view) - self.size} bytes missing")
            self.size += n

    def written(self) -> memoryview:
        """What was written so far, read-only (the object it shows is handed out by take())."""
        if self._view is None:
            raise ValueError("taken already")
        return self._view[:self.size].toreadonly()

    def take(self) -> Any:
        """The object, once every byte was written (ValueError otherwise)."""
        if self._view is None or self._data is None:
            raise ValueError("taken already")
        if self.size != len(self._view):
            raise ValueError(f"{self.size} of {len(self._view)} bytes written")
        view, data = self._view, self._data
        self._view = self._data = None
        view.release()
        return data


class FreshAscii(FreshBytes):
    """The same for an ASCII ``str``: the writer guarantees every byte it writes is ASCII
    (a str of one kind, whose characters are its bytes)."""

    @staticmethod
    def _new(size: int) -> str:
        return new_str(size, 127)

    @staticmethod
    def _address(obj: bytes | str) -> int:
        return str_address(obj, None)


# a piece over this is copied in slices, the GIL lane taken for one at a time: a 27 MB answer
# copied in one go kept the lane's other users waiting for all of it
COPY_SLICE_BYTES = 1 << 20


def joined(pieces: Sequence[bytes | memoryview], size: int) -> bytes:
    """``b"".join(pieces)`` (of `size` bytes in all), copied in the GIL lane into the object
    returned, a piece or a COPY_SLICE_BYTES slice of one at a time: never one copy of it all."""
    if size < 2:
        return b"".join(pieces)
    out = FreshBytes(size)
    for piece in pieces:
        view = memoryview(piece)
        if view.nbytes <= COPY_SLICE_BYTES or not view.contiguous:
            in_lane(view.nbytes, out.write, piece)
            continue
        flat = view.cast("B")  # its slices are views, not copies
        for at in range(0, len(flat), COPY_SLICE_BYTES):
            in_lane(COPY_SLICE_BYTES, out.write, flat[at:at + COPY_SLICE_BYTES])
    return out.take()

"""The pages of a request's big objects handed back before the objects are freed, with the
GIL released.

Freeing a big object unmaps its pages (munmap) with the GIL held: 3-4 ms for a 20 MB
``bytes`` of 4 KiB pages, while every other thread, the event loop first, waits. Under load
the freeing thread (a low-priority worker) is also preempted in the middle, and the loop
waited 10 ms and more for the GIL. ``madvise(MADV_DONTNEED)`` does that work through ctypes,
which releases the GIL for the call; the munmap that follows finds no pages left (0.03 ms).

Only objects that nothing outside the given list can reach are touched (their pages read as
zeros afterwards): every object on the way from the list to a buffer must have exactly the
references that the way accounts for, so a buffer that anything else holds, directly or
through a view (memoryview, numpy.frombuffer) or a shared container, is left as it is.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import types
import weakref
from typing import Any

from services.runtime.codecs.raw_buffers import buffer_address

MIN_BYTES = 1 << 20        # smaller objects have few pages: their munmap is short anyway
MAX_NODES = 512            # the walk holds the GIL: a request's objects are far fewer
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               types.CodeType, types.FrameType, types.CellType, types.TracebackType, weakref.ReferenceType)

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.restype, _madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):  # no libc madvise (not Linux): the objects are freed as they are
    _madvise = None


def hand_back_pages(garbage: list, min_bytes: int = MIN_BYTES) -> int:
    """Hand back the whole pages of the big buffers (``bytes``, ASCII ``str``, ``bytearray``,
    numpy arrays that own their data; of `min_bytes` or more) that only `garbage` holds; the
    caller frees `garbage` right after and keeps no other reference to what it holds.
    Returns the bytes handed back. (A smaller `min_bytes` suits many buffers of a few hundred
    kB freed together: heap blocks, whose frees add up to a heap trim with the GIL held.)"""
    if _madvise is None:
        return 0
    spans = [span for span in map(_span, _sole_buffers(garbage, min_bytes)) if span is not None]
    total = 0
    for start, length in spans:
        if _madvise(start, length, _MADV_DONTNEED) == 0:  # (the GIL is released for the call)
            total += length
    return total


def _sole_buffers(garbage: list, min_bytes: int = MIN_BYTES) -> list[Any]:
    """The big buffers that are reachable from `garbage` only: a walk from it that counts the
    references it crosses. An object qualifies when its reference count is what the walk saw
    and every object that refers to it qualifies (decided from the list down, so that objects
    in a cycle, which live on until the garbage collector's turn, never do)."""
    seen, parents = _walk(garbage)
    # getrefcount's own argument and `seen` hold one reference each; a weak reference is a
    # way in that the count misses (a WeakValueDictionary hands the object back to anyone)
    owned = [at == 0 or (sys.getrefcount(seen[at]) - 2 == len(parents[at])
                         and weakref.getweakrefcount(seen[at]) == 0) for at in range(len(seen))]
    children: list[list[int]] = [[] for _ in seen]
    waiting = [len(p) for p in parents]   # references from objects not known to qualify yet
    for at, refs in enumerate(parents):
        for parent in refs:
            children[parent].append(at)
    sole, ready = [False] * len(seen), [0]
    while ready:
        at = ready.pop()
        sole[at] = True
        for child in children[at]:
            waiting[child] -= 1
            if waiting[child] == 0 and owned[child]:
                ready.append(child)
    return [seen[at] for at in range(1, len(seen)) if sole[at] and _big_buffer(seen[at], min_bytes)]


def _walk(garbage: list) -> tuple[list[Any], list[list[int]]]:
    """Every object reachable from `garbage` (at most MAX_NODES), and for each the positions
    of those seen that refer to it, once per reference. (A function of its own: no local
    variable of it outlives the walk to hold a reference that the count would miss.)"""
    seen: list[Any] = [garbage]
    index = {id(garbage): 0}
    parents: list[list[int]] = [[]]
    position = 0
    while position < len(seen) and len(seen) < MAX_NODES:
        if position == 0 or _walked(seen[position]):
            for child in gc.get_referents(seen[position]):
                at = index.get(id(child))
                if at is None:
                    if len(seen) >= MAX_NODES:
                        break
                    at = index[id(child)] = len(seen)
                    seen.append(child)
                    parents.append([])
                parents[at].append(position)
        position += 1
    return seen, parents


def _walked(obj: Any) -> bool:
    """(Not gc.is_tracked: CPython stops tracking a dict or tuple that holds only objects the
    collector does not track, as numpy arrays are, and get_referents walks it all the same.)"""
    # (the type itself, not isinstance: a proxy's __class__ is code of its own, and may raise)
    return not issubclass(type(obj), _NOT_WALKED) and not hasattr(type(obj), "__del__")  # a finalizer might read it


def _big_buffer(obj: Any, min_bytes: int = MIN_BYTES) -> bool:
    # exact types only: a subclass may have a finalizer that reads it, or a __len__ that is
    # not its size (the pages past its end would be handed back)
    kind = type(obj)
    if kind is bytes or kind is bytearray:
        return len(obj) >= min_bytes
    if kind is str:  # a compact ASCII str: its characters are its bytes
        return obj.isascii() and len(obj) >= min_bytes and not _interned(obj)
    if kind.__name__ == "ndarray" and kind.__module__ == "numpy":
        # (not an array of objects: its data are references, which must still be released)
        return (obj.nbytes >= min_bytes and obj.base is None and obj.flags.owndata and obj.flags.c_contiguous
                and not obj.dtype.hasobject)
    return False


_STR_STATE = 4 * ctypes.sizeof(ctypes.c_ssize_t)  # PyASCIIObject: refcount, type, length, hash, then state


def _interned(text: str) -> bool:
    """Whether the str is interned: the table's reference is not in its count (3.11, 3.13),
    and another thread interning an equal string would get this very object back."""
    return ctypes.c_uint32.from_address(id(text) + _STR_STATE).value & 3 != 0


def _span(obj: Any) -> tuple[int, int] | None:
    """The whole pages inside the object's data: (start, length), or None."""
    address, size = buffer_address(obj)
    start = (address + _PAGE - 1) & ~(_PAGE - 1)
    end = (address + size) & ~(_PAGE - 1)
    return (start, end - start) if end > start else None

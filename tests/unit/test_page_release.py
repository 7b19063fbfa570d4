"""A request's big objects give their pages back before they are freed, with the GIL released,
and only when nothing outside the list can still reach them (services.runtime.codecs.page_release)."""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest

from services.runtime.codecs import page_release
from services.runtime.codecs.gil_lane import release_on
from services.runtime.codecs.page_release import hand_back_pages
from services.runtime.codecs.raw_buffers import buffer_address

MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _filled(n: int) -> bytes:
    return os.urandom(1) * n if n < MB else (os.urandom(4096) * (n // 4096 + 1))[:n]


class Request:
    def __init__(self, body):
        self.body = body
        self.params = {"image": body, "steps": 20}


@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
@pytest.mark.parametrize("kind", ["bytes", "ascii str", "bytearray", "ndarray", "nested in objects"])
def test_what_only_the_list_holds_gives_its_pages_back(kind):
    size = 64 * MB
    make = {"bytes": lambda: _filled(size), "ascii str": lambda: "A" * size,
            "bytearray": lambda: bytearray(_filled(size)), "ndarray": lambda: np.ones(size, np.uint8),
            "nested in objects": lambda: Request(_filled(size))}[kind]
    garbage = [make()]
    before = _rss()
    handed = hand_back_pages(garbage)
    assert size - 2 * 4096 <= handed <= size
    assert before - _rss() >= size // 2      # the pages left the process, while the object still lives
    garbage.clear()


@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
def test_a_buffer_shared_twice_inside_the_list_still_qualifies():
    body = _filled(8 * MB)
    garbage = [Request(body), body, (body,)]
    del body
    assert hand_back_pages(garbage) >= 8 * MB - 2 * 4096


def _kept(scenario: str):
    """(garbage, what else holds it, the bytes that must stay as they were)."""
    body = _filled(8 * MB)
    if scenario == "another reference":
        return [Request(body)], body, body
    if scenario == "a memoryview":
        view = memoryview(body)
        return [body], view, body
    if scenario == "numpy.frombuffer":
        arr = np.frombuffer(body, np.uint8)
        return [body], arr, body
    if scenario == "a numpy view of an array":
        arr = np.frombuffer(body, np.uint8).copy()
        view = arr[4096:]
        return [arr], view, view
    if scenario == "a container held elsewhere":
        req = Request(body)
        return [req], req, body
    if scenario == "a dict held elsewhere":
        params = {"image": body}
        return [{"params": params}], params, body
    if scenario == "a cycle":
        ring: list = [None, body]
        ring[0] = ring
        return [ring], None, body
    raise AssertionError(scenario)


@pytest.mark.parametrize("scenario", ["another reference", "a memoryview", "numpy.frombuffer",
                                      "a numpy view of an array", "a container held elsewhere",
                                      "a dict held elsewhere", "a cycle"])
def test_what_anything_else_can_reach_is_left_as_it_is(scenario):
    garbage, holder, watched = _kept(scenario)
    copy = bytes(watched)
    assert hand_back_pages(garbage) == 0
    garbage.clear()
    assert bytes(watched) == copy
    del holder


def test_an_interned_string_is_left_as_it_is():
    """The interned table's reference is not in the string's count: another thread interning
    an equal string gets this very object back, so its pages must stay."""
    import sys
    garbage = [sys.intern("".join(["K"] * (2 * MB)))]  # only the list (and the table) hold it
    assert hand_back_pages(garbage) == 0
    garbage.clear()
    assert sys.intern("".join(["K"] * (2 * MB))) == "K" * (2 * MB)


def test_an_object_whose_class_lookup_raises_is_walked_past():
    class Unbound:  # like a context-bound proxy outside its context
        @property
        def __class__(self):
            raise RuntimeError("working outside of application context")

    assert hand_back_pages([{"user": Unbound(), "body": _filled(2 * MB)}]) >= 2 * MB - 2 * 4096


def test_small_objects_and_finalizers_are_not_touched():
    class Finalized:
        def __init__(self, data):
            self.data = data

        def __del__(self):
            pass

    assert hand_back_pages([_filled(MB - 1), Finalized(_filled(4 * MB))]) == 0


@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
def test_the_page_work_releases_the_gil():
    from tests.unit.test_gil_lane import _other_threads_ran_during
    ready = [_filled(128 * MB) for _ in range(3)]   # made beforehand: only the hand-back is watched

    def work():
        garbage = [ready.pop()]
        hand_back_pages(garbage)

    assert _other_threads_ran_during(work, tries=3)


def test_a_requests_garbage_is_handed_back_before_it_is_freed(monkeypatch):
    """release_on (the CPU pool's release) asks for the pages of the big objects while they
    still live, then frees them. (madvise is faked here; the tests above use the real one.)"""
    body = _filled(16 * MB)
    address, size = buffer_address(body)
    garbage = [Request(body)]
    del body
    calls = []
    monkeypatch.setattr(page_release, "_madvise", lambda start, length, advice: calls.append(
        (start, length, advice, len(garbage))) or 0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        release_on(pool, garbage)
    assert len(calls) == 1 and garbage == []
    start, length, advice, held = calls[0]
    assert advice == 4 and held == 1   # MADV_DONTNEED, while the list still held the request
    assert address <= start and start + length <= address + size and length >= size - 2 * 4096


def test_the_walk_is_bounded():
    many = [[_filled(16)] for _ in range(page_release.MAX_NODES * 4)]
    seen, parents = page_release._walk([many])
    assert len(seen) == len(parents) <= page_release.MAX_NODES
    del seen, parents
    assert hand_back_pages([many]) == 0


class _Finalized(bytes):
    """A bytes whose own finalizer reads it (after the list is freed)."""
    read: list = []

    def __del__(self):
        _Finalized.read.append(bytes(self[8192:8200]))


class _Weakly(bytearray):
    pass


def _reached_without_a_reference(scenario: str):
    """(garbage, what reads the bytes later without a counted reference, the bytes expected):
    reference counts do not see weak references, and a subclass may run code of its own."""
    import weakref
    body = _filled(8 * MB)
    want = body[8192:8200]
    if scenario == "a weak reference to a container":
        registry = weakref.WeakValueDictionary()
        req = Request(body)
        registry["req"] = req
        garbage = [req]
        del req, body
        return garbage, lambda: registry["req"].body[8192:8200], want
    if scenario == "a weak reference to the buffer":
        buf = _Weakly(body)
        ref = weakref.ref(buf)
        garbage = [buf]
        del buf, body
        return garbage, lambda: bytes(ref()[8192:8200]), want
    if scenario == "a finalizer of the buffer":
        _Finalized.read.clear()
        garbage = [_Finalized(body)]
        del body
        return garbage, lambda: None, want
    raise AssertionError(scenario)


@pytest.mark.parametrize("scenario", ["a weak reference to a container", "a weak reference to the buffer",
                                      "a finalizer of the buffer"])
def test_what_can_be_reached_without_a_counted_reference_is_left_as_it_is(scenario):
    garbage, read, want = _reached_without_a_reference(scenario)
    hand_back_pages(garbage)
    if scenario == "a finalizer of the buffer":
        garbage.clear()
        assert _Finalized.read == [want]
    else:
        assert read() == want   # (a weak reference gives the object back: another thread may keep it)
        garbage.clear()


def test_an_array_of_objects_keeps_its_references_to_release():
    """Its data are references: zeroed, they would never be released (and what they hold would leak)."""
    import sys
    held = object()
    array = np.empty(MB // 4, dtype=object)
    array[:] = held
    garbage = [array]
    del array
    before = sys.getrefcount(held)
    hand_back_pages(garbage)
    garbage.clear()
    assert before - sys.getrefcount(held) == MB // 4


@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
def test_heap_blocks_hand_back_only_their_own_pages():
    """A smaller bound (min_bytes) reaches buffers in the malloc heap, beside other blocks:
    only the whole pages inside a buffer's own bytes are handed back, so its neighbours, its
    header and the allocator's bookkeeping around it stay as they were."""
    size = 100 * 1024  # under glibc's mmap threshold: heap blocks, side by side
    blocks = [_filled(size) for _ in range(64)]
    kept, garbage = blocks[0::2], blocks[1::2]
    copies = [bytes(b) for b in kept]
    del blocks
    assert hand_back_pages(garbage, 64 * 1024) >= len(garbage) * (size - 2 * 4096)
    assert all(b == c for b, c in zip(kept, copies, strict=True))
    assert all(len(b) == size for b in garbage)   # (their headers are intact: they are still bytes)
    garbage.clear()
    again = [_filled(size) for _ in range(32)]   # the freed blocks serve new ones
    assert all(b == c for b, c in zip(kept, copies, strict=True))
    assert all(len(b) == size for b in again)

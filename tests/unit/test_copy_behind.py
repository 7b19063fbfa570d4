"""A big upload's pieces are copied into its bytes object by the copier thread, not by the
event loop, in order, and the object is handed out only once every copy is done
(services.runtime.codecs.copy_behind)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from services.runtime.codecs import copy_behind
from services.runtime.codecs.copy_behind import CopyBehind
from services.runtime.codecs.fresh_bytes import GIL_FREE_COPY_BYTES, FreshBytes

BIG = GIL_FREE_COPY_BYTES


def test_pieces_big_and_small_come_back_whole_and_in_order():
    data = os.urandom(40 * BIG + 123)
    cuts = [0, 10, BIG, 3 * BIG + 7, 3 * BIG + 8, 20 * BIG, 21 * BIG - 5, len(data)]
    out = CopyBehind(FreshBytes(len(data)))
    for a, b in zip(cuts, cuts[1:], strict=False):
        out.write(data[a:b])
    got = asyncio.run(out.take())
    assert type(got) is bytes and got == data


def test_big_bytes_are_copied_on_the_copier_thread_and_take_waits_for_them(monkeypatch):
    release, threads = threading.Event(), []
    real = copy_behind.copy_into

    def slow_copy(address, piece):
        threads.append(threading.current_thread().name)
        release.wait(10)
        real(address, piece)
    monkeypatch.setattr(copy_behind, "copy_into", slow_copy)
    head, big, tail = b"h" * 100, os.urandom(2 * BIG), b"t" * 50
    out = CopyBehind(FreshBytes(len(head) + len(big) + len(tail)))

    async def run():
        out.write(head)              # small: in place at once
        out.write(big)               # queued: the caller goes on
        out.write(tail)              # small, after a queued piece: in place at once too
        assert bytes(out.written()) == head  # only what is certainly in place is shown
        taking = asyncio.ensure_future(out.take())
        await asyncio.sleep(0.2)
        assert not taking.done()     # the copy is held back: no object yet
        release.set()
        return await asyncio.wait_for(taking, 10)
    got = asyncio.run(run())
    assert got == head + big + tail
    assert threads == ["onecard-copier"]


def test_a_mutable_piece_is_copied_at_once():
    # a bytearray may change after write() returns: it is never queued
    piece = bytearray(os.urandom(2 * BIG))
    out = CopyBehind(FreshBytes(len(piece)))
    out.write(piece)
    expected = bytes(piece)
    piece[:] = b"\0" * len(piece)
    assert asyncio.run(out.take()) == expected


def test_more_than_the_object_holds_is_refused_before_anything_is_queued():
    out = CopyBehind(FreshBytes(BIG))
    with pytest.raises(ValueError):
        out.write(os.urandom(BIG + 1))
    assert out.size == 0


def test_a_copy_that_fails_fails_the_take_and_the_copier_goes_on(monkeypatch):
    real, calls = copy_behind.copy_into, []

    def flaky(address, piece):
        calls.append(len(piece))
        if len(calls) == 1:
            raise BufferError("refused")
        real(address, piece)
    monkeypatch.setattr(copy_behind, "copy_into", flaky)
    broken = CopyBehind(FreshBytes(BIG))
    broken.write(os.urandom(BIG))
    with pytest.raises(RuntimeError):
        asyncio.run(broken.take())
    data = os.urandom(BIG)
    fine = CopyBehind(FreshBytes(BIG))
    fine.write(data)                 # the same copier thread, still there
    assert asyncio.run(asyncio.wait_for(fine.take(), 10)) == data

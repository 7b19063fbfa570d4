"""A dry run that the hook ends after its cost check ends on the worker: what the hook made of
the body (its frames hold it) is freed there, not on the event loop that awaits the result
(services.runtime.pipeline.model_routes)."""

from __future__ import annotations

import collections.abc
import concurrent.futures
import os
import threading
import weakref

import pytest

from services.runtime.codecs import page_release
from services.runtime.codecs.raw_buffers import buffer_address
from services.runtime.pipeline.cost import DryRunComplete
from services.runtime.pipeline.model_routes import _decode_or_none, held_only_by


class Made:
    """Stands for a big string or picture the hook made; records the thread that frees it."""
    freed_on: list[str] = []

    def __del__(self):
        Made.freed_on.append(threading.current_thread().name)


def test_the_end_of_a_dry_run_frees_the_hooks_objects_on_the_worker():
    refs = []

    def decode(raw):
        made = Made()
        refs.append(weakref.ref(made))
        raise DryRunComplete()

    Made.freed_on.clear()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        assert pool.submit(_decode_or_none, decode, object()).result() is None
    assert refs[0]() is None and Made.freed_on == ["worker_0"]


def test_other_errors_and_results_pass_through():
    assert _decode_or_none(lambda raw: ["work"], object()) == ["work"]
    with pytest.raises(ValueError):
        _decode_or_none(lambda raw: (_ for _ in ()).throw(ValueError("bad")), object())


def _recording_madvise(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = page_release._madvise

    def madvise(address, length, advice):
        calls.append((address, length))
        return real(address, length, advice)
    monkeypatch.setattr(page_release, "_madvise", madvise)
    return calls


@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
def test_the_hooks_big_objects_hand_their_pages_back_before_they_are_freed(monkeypatch):
    """Freed with their frames, a dry run's 20 MB string and decoded picture were unmapped with
    the GIL held (5-7 ms a dry run, the event loop waiting): their pages go first."""
    calls = _recording_madvise(monkeypatch)
    spans = []

    class Request:  # stands for onecard's, whose fields hold what the hook made
        pass

    def hook(request):
        picture = os.urandom(4096) * 1024               # a local of the hook: 4 MB
        request.fields = {"text": "A" * (3 << 20)}      # reached through an object the frames hold
        spans.extend(buffer_address(o) for o in (picture, request.fields["text"]))
        raise DryRunComplete()

    def decode(raw):
        request = Request()
        return hook(request)

    assert _decode_or_none(decode, object()) is None
    for address, size in spans:
        assert any(address <= a and a + n <= address + size and n >= size - 2 * 4096 for a, n in calls), \
            (address, size, calls)


@pytest.mark.skipif(page_release._madvise is None, reason="no madvise here")
def test_what_the_service_still_holds_keeps_its_pages(monkeypatch):
    calls = _recording_madvise(monkeypatch)
    kept = [os.urandom(4096) * 1024]
    settings = {"table": os.urandom(4096) * 1024}

    def decode(raw):
        mine, table = kept[0], settings["table"]  # locals of the hook that others hold too
        raise DryRunComplete(len(mine) + len(table))

    assert _decode_or_none(decode, object()) is None
    assert calls == []
    assert kept[0][:4096] * 1024 == kept[0] and settings["table"][:4096] * 1024 == settings["table"]


def test_held_only_by_keeps_what_nothing_else_holds():
    mine, shared = bytearray(10), bytearray(10)
    elsewhere = [shared]
    values = [mine, shared, mine]
    del mine
    kept = held_only_by(values)
    assert values == [] and len(kept) == 1 and kept[0] is not shared and elsewhere == [shared]


class _Unbound:
    """Like a context-bound proxy used outside its context: its __class__ raises."""

    @property
    def __class__(self):
        raise RuntimeError("working outside of application context")


class _RefusingLocals(collections.abc.Mapping):
    def __init__(self):
        self.d = {}

    def __getitem__(self, key):
        return self.d[key]

    def __setitem__(self, key, value):
        self.d[key] = value

    def __iter__(self):
        return iter(self.d)

    def __len__(self):
        return len(self.d)

    def values(self):
        raise RuntimeError("values() not supported")


def test_odd_locals_still_end_the_dry_run_with_its_answer():
    def proxy_in_a_local(raw):
        request = {"user": _Unbound(), "body": bytearray(8)}  # noqa: F841 -- only the hook holds it
        raise DryRunComplete()

    def locals_that_refuse(raw):
        exec("raise DryRunComplete()", {"DryRunComplete": DryRunComplete}, _RefusingLocals())

    assert _decode_or_none(proxy_in_a_local, object()) is None
    assert _decode_or_none(locals_that_refuse, object()) is None

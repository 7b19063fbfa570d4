"""A dry run that the hook ends after its cost check ends on the worker: what the hook made of
the body (its frames hold it) is freed there, not on the event loop that awaits the result
(services.runtime.pipeline.model_routes)."""

from __future__ import annotations

import concurrent.futures
import threading
import weakref

import pytest

from services.runtime.pipeline.cost import DryRunComplete
from services.runtime.pipeline.model_routes import _decode_or_none


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

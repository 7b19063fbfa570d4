"""Failures on the model: a bad item fails alone, a raising batch is retried item by item
(never for an item whose client left), out of memory is a 503 with Retry-After after
memory was freed once, an ApiError passes through unchanged, a wrong result count fails
the request with the reason."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from services.runtime.errors import ApiError, ClientGone
from services.runtime.pipeline.timing import Timing
from tests.fakes.model_backend import Client, Item, dropped, hold, run, scheduler, until


async def batch_of_two_that_runs_out_of_memory(sched, backend) -> None:
    """o1 and o2 queued behind a held call, so that they run as one batch, which o1 makes
    run out of memory (then each is retried alone)."""
    backend.raise_on_batch = "o1"
    blocker = await hold(sched, backend)
    tasks = [asyncio.ensure_future(sched.submit([Item(n)], None, Timing(), None)) for n in ("o1", "o2")]
    await until(lambda: sched.pending_items == 2)
    backend.gate.set()
    await asyncio.gather(blocker, *tasks)


def test_a_bad_item_fails_alone_and_a_raising_batch_is_retried_item_by_item():
    async def main():
        sched, backend = scheduler()
        backend.raise_on_batch = "x2"
        blocker = await hold(sched, backend)
        tasks = [asyncio.ensure_future(sched.submit([Item(n, fail=(n == "x3"))], None, Timing(), None))
                 for n in ("x1", "x2", "x3")]
        await until(lambda: sched.pending_items == 3)
        backend.gate.set()
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
        await sched.stop()
        return backend.batches[1:], results[1:], backend.freed

    batches, results, freed = run(main())
    assert batches == [["x1", "x2", "x3"], ["x1"], ["x2"], ["x3"]]
    assert results[0] == ["out:x1"] and results[1] == ["out:x2"]
    assert isinstance(results[2], ValueError)
    assert freed == 1  # the out-of-memory batch freed memory once


def _held_batch(infer, payloads: tuple[str, ...]):
    """`payloads` run as one batch (queued behind p0's held call) on a backend whose call is
    `infer`: (every call's items, in order; p0's result and each payload's, or its exception)."""
    async def main():
        sched, backend = scheduler()
        calls, gate, entered = [], threading.Event(), threading.Event()

        def held(items):
            calls.append(list(items))
            entered.set()
            gate.wait(5)
            return infer(items)
        backend.infer_batch = held
        try:
            blocker = asyncio.ensure_future(sched.submit(["p0"], None, Timing(), None))
            await until(entered.is_set)
            tasks = [asyncio.ensure_future(sched.submit([p], None, Timing(), None)) for p in payloads]
            await until(lambda: sched.pending_items == len(payloads))
        finally:
            gate.set()
        results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
        await sched.stop()
        return calls, results
    return run(main())


def test_a_failing_batch_of_plain_payloads_is_retried_one_by_one():
    def infer(items):
        if len(items) > 1:
            raise RuntimeError("a bad batch")
        return [f"out:{i}" for i in items]
    calls, results = _held_batch(infer, ("p1", "p2"))
    assert calls == [["p0"], ["p1", "p2"], ["p1"], ["p2"]] and results == [["out:p0"], ["out:p1"], ["out:p2"]]


def test_out_of_memory_alone_is_a_503():
    async def main():
        sched, backend = scheduler()

        def oom(items):
            raise RuntimeError("CUDA out of memory")
        backend.infer_batch = oom
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("big")], None, Timing(), None)
        await sched.stop()
        return err.value, backend.freed

    err, freed = run(main())
    assert (err.status, err.code) == (503, "out_of_memory") and freed == 1


# ---- out of memory and the retry item by item ----------------------------------------------------
def test_out_of_memory_is_a_503_with_retry_after_logged_and_counted(caplog):
    async def main():
        sched, backend = scheduler(retry_after_s=7)

        def oom(items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

        def failing_free():
            raise RuntimeError("cache flush failed")
        backend.infer_batch = oom
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("big")], "k", Timing(), None)
        backend.on_out_of_memory = failing_free
        with pytest.raises(ApiError) as again:  # freeing memory failed: still a 503, not a crash
            await sched.submit([Item("big")], "k", Timing(), None)
        out_of_memory = dropped(sched, "out_of_memory")
        await sched.stop()
        return err.value, again.value, out_of_memory

    with caplog.at_level(logging.WARNING, logger="onecard.service"):
        err, again, count = run(main())
    assert (err.status, err.code) == (503, "out_of_memory")
    assert err.message == "the model ran out of GPU memory; retry later"
    assert err.headers == {"Retry-After": "7"}
    assert (again.status, again.code) == (503, "out_of_memory") and count == 2
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("GPU out of memory: CUDA out of memory. Tried to allocate 2 GiB") == 2
    failed = [r for r in caplog.records if r.getMessage() == "freeing memory after out-of-memory failed"]
    assert len(failed) == 1 and failed[0].exc_info and "cache flush failed" in str(failed[0].exc_info[1])


def test_an_out_of_memory_batch_logs_the_error_and_frees_memory_once_before_the_retries(caplog):
    async def main():
        sched, backend = scheduler()
        await batch_of_two_that_runs_out_of_memory(sched, backend)
        await sched.stop()
        return backend.freed

    with caplog.at_level(logging.WARNING, logger="onecard.service"):
        freed = run(main())
    assert freed == 1
    assert [r.getMessage() for r in caplog.records] == \
        ["GPU out of memory: CUDA out of memory. Tried to allocate 1 GiB"]


def test_an_api_error_from_the_backend_passes_through_unchanged():
    async def main():
        sched, backend = scheduler()

        def refuse(items):
            raise ApiError(507, "no_room", "out of memory on disk")
        backend.infer_batch = refuse
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("x")], "k", Timing(), None)
        await sched.stop()
        return err.value, backend.freed, dropped(sched, "out_of_memory")

    err, freed, count = run(main())
    assert (err.status, err.code, err.message) == (507, "no_room", "out of memory on disk")
    assert freed == 0 and count == 0


def test_an_item_whose_client_left_is_not_retried_alone():
    """A batch fails and is retried item by item; an item whose client left meanwhile is
    skipped, not run alone."""
    async def main():
        sched, backend = scheduler()
        calls, gate, on_model, pair_gate = [], threading.Event(), threading.Event(), threading.Event()

        def infer(items):
            calls.append([i.name for i in items])
            on_model.set()
            gate.wait(5)
            if len(items) > 1:
                pair_gate.wait(5)
                raise RuntimeError("a bad batch")
            return [f"out:{i.name}" for i in items]
        backend.infer_batch = infer
        blocker = asyncio.ensure_future(sched.submit([Item("blocker")], "hold", Timing(), None))
        await until(on_model.is_set)
        client = Client()
        gone = asyncio.ensure_future(
            sched.submit([Item("x1", cancel=threading.Event())], "k", Timing(), client.receive))
        stays = asyncio.ensure_future(sched.submit([Item("x2")], "k", Timing(), None))
        await until(lambda: sched.pending_items == 2)
        gate.set()
        await blocker
        await until(lambda: len(calls) == 2)  # [x1, x2] is on the model
        client.gone.set()
        with pytest.raises(ClientGone):
            await gone
        pair_gate.set()
        results = await asyncio.gather(gone, stays, return_exceptions=True)
        await sched.stop()
        return calls, results

    calls, results = run(main())
    assert calls[:2] == [["blocker"], ["x1", "x2"]]
    assert calls[2:] == [["x2"]], "x1's client had left: only x2 is retried"
    assert results[1] == ["out:x2"]


def test_a_backend_returning_the_wrong_number_of_results_fails_the_request_with_the_reason():
    async def main():
        sched, backend = scheduler()
        backend.infer_batch = lambda items: []
        with pytest.raises(RuntimeError) as err:
            await sched.submit([Item("x")], None, Timing(), None)
        await sched.stop()
        return str(err.value)

    assert run(main()) == "backend returned 0 results for 1 items"


def test_a_batch_refused_with_an_api_error_naming_memory_frees_nothing_and_each_item_keeps_its_answer():
    async def main():
        sched, backend = scheduler()

        def refuse(items):
            backend.batches.append([i.name for i in items])
            backend.entered.set()
            backend.gate.wait(5)
            raise ApiError(413, "too_costly", "out of memory: this picture is too big")
        backend.infer_batch = refuse
        backend.gate.clear()
        first = asyncio.ensure_future(sched.submit([Item("a")], "k", Timing(), None))
        await until(backend.entered.is_set)
        rest = [asyncio.ensure_future(sched.submit([Item(n)], "k", Timing(), None)) for n in ("b", "c")]
        await until(lambda: sched.pending_items == 2)
        backend.gate.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        await sched.stop()
        return backend.batches, results, backend.freed, dropped(sched, "out_of_memory")

    batches, results, freed, count = run(main())
    assert batches == [["a"], ["b", "c"], ["b"], ["c"]]
    assert [(r.status, r.code) for r in results] == [(413, "too_costly")] * 3
    assert freed == 0 and count == 0


def test_memory_is_freed_on_the_worker_thread_never_on_the_event_loop():
    """on_out_of_memory is a full collection and the allocator's cache handed back (GPU work):
    the loop that answers /healthz must not run it, for a batch or for one item."""
    async def main():
        sched, backend = scheduler()
        loop_thread, threads = threading.current_thread(), []
        backend.on_out_of_memory = lambda: threads.append(threading.current_thread())
        await batch_of_two_that_runs_out_of_memory(sched, backend)

        def oom(items):
            raise RuntimeError("CUDA out of memory")
        backend.infer_batch = oom
        with pytest.raises(ApiError):
            await sched.submit([Item("big")], None, Timing(), None)
        await sched.stop()
        return loop_thread, threads

    loop_thread, threads = run(main())
    assert len(threads) == 2 and all(t is not loop_thread for t in threads)


def test_memory_is_freed_after_out_of_memory_with_the_failed_call_s_buffers_already_let_go():
    """The failure's traceback held the frames of the call that ran out, and with them what
    the model had allocated: the cache could not be given back while it was still held."""
    import gc
    import weakref

    class Buffer:
        pass

    async def main():
        sched, backend = scheduler()
        seen = {}

        def oom(items):
            activations = Buffer()
            seen["ref"] = weakref.ref(activations)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

        def free():
            gc.collect()
            seen["held_when_freed"] = seen["ref"]() is not None
        backend.infer_batch = oom
        backend.on_out_of_memory = free
        with pytest.raises(ApiError) as err:
            await sched.submit([Item("big")], "k", Timing(), None)
        await sched.stop()
        return err.value, seen

    err, seen = run(main())
    assert (err.status, err.code) == (503, "out_of_memory") and seen["held_when_freed"] is False


def test_a_backend_with_one_result_too_many_gives_no_item_another_s_answer():
    """Retried one by one after the batch's wrong count, each call again answered one too many:
    its first was taken for the item's own (helper-46: three of four batched requests got 200
    with another output)."""
    calls, results = _held_batch(lambda items: ["extra"] + [f"out:{i}" for i in items], ("p1", "p2", "p3"))
    assert calls[1:] == [["p1", "p2", "p3"], ["p1"], ["p2"], ["p3"]]
    assert all(isinstance(r, RuntimeError) and "2 results for 1 item" in str(r) for r in results[1:]), results


@pytest.mark.parametrize("exit_with", [SystemExit(4), KeyboardInterrupt("hostile")])
def test_a_model_that_exits_fails_its_item_alone_and_the_service_goes_on(exit_with):
    """sys.exit() (or Ctrl-C's exception) from the model: a BaseException the executor handed back
    as it was, past every `except Exception`, to uvicorn (plain-text 500, the service gone)."""
    def infer(items):
        if "p2" in items:
            raise exit_with
        return [f"out:{i}" for i in items]
    calls, results = _held_batch(infer, ("p1", "p2", "p3"))
    assert calls[1:] == [["p1", "p2", "p3"], ["p1"], ["p2"], ["p3"]]
    assert results[1] == ["out:p1"] and results[3] == ["out:p3"]
    assert type(results[2]).__name__ == "HookExit" and type(exit_with).__name__ in str(results[2]), results

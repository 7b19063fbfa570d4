"""Warm-up on a model whose memory budget holds fewer than max_batch_size items: the climb
through batch sizes stops at the first size that runs out of memory, and only then."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from services.runtime.errors import ApiError
from services.runtime.pipeline.backend import is_out_of_memory
from services.runtime.pipeline.cost import ServiceCost
from services.runtime.pipeline.warmup import warm_up

ORT_ARENA = ("[ONNXRuntimeError] : 1 : FAIL : bfc_arena.cc:360 Available memory of 41601536 is smaller than "
             "requested bytes of 157286400")


class Model:
    supports_batching = True
    device = "cpu"

    def __init__(self, fits: int, error: str = ORT_ARENA, items: int = 1):
        self.fits, self.error, self.items = fits, error, items
        self.calls: list[int] = []
        self.freed = 0

    def warmup_items(self):
        return ["w"] * self.items

    def item_pixels(self, item):
        return 100

    def item_work(self, item):
        return 1.0

    def infer_batch(self, items):
        self.calls.append(len(items))
        if len(items) > self.fits:
            raise RuntimeError(self.error)
        return [{"ok": True} for _ in items]

    def on_out_of_memory(self):
        self.freed += 1


async def _run(fn, *args, tracked=True):
    return fn(*args)


def warm(model: Model, max_batch: int = 8):
    cost = ServiceCost(model, max_batch)
    return asyncio.run(warm_up(model, _run, cost, 1, max_batch)), cost


@pytest.mark.parametrize("text", [ORT_ARENA, "CUDA out of memory. Tried to allocate 2.00 GiB",
                                  "CUDNN_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation: out of memory",
                                  "Failed to allocate memory for requested buffer of size 1"])
def test_allocation_failures_of_torch_onnxruntime_cuda_and_cudnn_are_out_of_memory(text):
    assert is_out_of_memory(RuntimeError(text))


def test_an_ordinary_failure_is_not_out_of_memory():
    assert not is_out_of_memory(RuntimeError("shape mismatch: memory layout"))


def test_the_climb_stops_at_the_first_size_that_runs_out_of_memory():
    model = Model(fits=3)
    out, cost = warm(model)
    assert out.max_batch == 2                       # 1, 2 ran; 4 did not; 8 was never tried
    assert 8 not in model.calls and model.freed == 1
    assert sorted(cost.curve.snapshot()["ms_by_batch_size"]) == ["1", "2"]


def test_every_size_that_fits_is_measured_and_the_limit_stays():
    out, cost = warm(Model(fits=8))
    assert out.max_batch == 8 and sorted(cost.curve.snapshot()["ms_by_batch_size"], key=int) == ["1", "2", "4", "8"]


def test_warm_up_items_that_do_not_fit_together_run_one_at_a_time():
    model = Model(fits=1, items=2)
    out, _ = warm(model)
    assert out.max_batch == 1 and model.calls[:2] == [2, 1]


def test_one_item_out_of_memory_fails_the_start_and_other_errors_are_not_swallowed():
    with pytest.raises(RuntimeError, match="smaller than requested"):
        warm(Model(fits=0))
    with pytest.raises(RuntimeError, match="shape"):
        warm(Model(fits=2, error="shape mismatch"))


def test_an_api_error_naming_memory_is_the_answer_the_backend_chose_not_out_of_memory():
    assert not is_out_of_memory(ApiError(413, "too_costly", "this picture would run out of memory: send a smaller one"))
    assert not is_out_of_memory(ApiError(507, "no_room", "out of memory on disk"))
    assert is_out_of_memory(ApiError(503, "out_of_memory", "the model ran out of GPU memory; retry later"))


@pytest.mark.parametrize("returned", [False, True])
def test_a_client_error_at_warm_up_fails_the_start_instead_of_capping_the_batches(returned):
    """Raised for the batch, or returned as one item's result: the start fails, as for any
    error but out of memory (a 4xx whose text says "out of memory" must not cap batches)."""
    error = ApiError(422, "invalid_parameter", "a batch of 4 would run out of memory: send fewer")
    model = Model(fits=2)

    def infer(items):
        model.calls.append(len(items))
        if len(items) > model.fits:
            if not returned:
                raise error
            return [error] * len(items)
        return [{"ok": True} for _ in items]
    model.infer_batch = infer
    with pytest.raises(Exception, match="would run out of memory") as caught:
        warm(model)
    assert model.freed == 0 and (caught.value is error or caught.value.failure is error)


def test_memory_is_freed_and_the_heap_trimmed_on_the_worker_never_on_the_event_loop(monkeypatch):
    from services.runtime.pipeline import warmup
    worker = concurrent.futures.ThreadPoolExecutor(1)
    threads: dict[str, threading.Thread] = {}

    async def on_worker(fn, *args, tracked=True):
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    async def main():
        threads["loop"] = threading.current_thread()
        return await warm_up(model, on_worker, ServiceCost(model, 8), 1, 8)

    model = Model(fits=2)
    model.on_out_of_memory = lambda: threads.setdefault("freed", threading.current_thread())
    monkeypatch.setattr(warmup.memory, "trim_heap", lambda: threads.setdefault("trimmed", threading.current_thread()))
    try:
        assert asyncio.run(main()).max_batch == 2
    finally:
        worker.shutdown()
    assert threads["freed"] is not threads["loop"] and threads["trimmed"] is not threads["loop"]

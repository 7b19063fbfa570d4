"""A model call's working memory on the card: the budget (or the card) minus what the model
holds, where "holds" is torch's allocations, not its cache of freed warm-up blocks. A fake
torch and card here; the real ones in tests/integration/test_gpu.py."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from services.runtime.device import gpu as device_gpu
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.cost import ServiceCost
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.pipeline.warmup import PeakProbe
from services.runtime.shell.model_part import ModelPart

GIB = 2**30


class CudaModel(Backend):
    device = "cuda"
    uses_torch = True

    def gpu_memory_bytes(self):
        return 10 * GIB     # torch's reserved memory after warm-up: weights and cached blocks


def plan(monkeypatch, probe: PeakProbe | None, budget: int | None, card: int | None):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(
        memory_allocated=lambda: 2 * GIB)))                     # the weights
    monkeypatch.setattr(device_gpu, "budget_bytes", lambda: budget)
    monkeypatch.setattr(device_gpu, "total_gpu_memory", lambda: card)
    backend = CudaModel()
    part = ModelPart("svc", ModelServiceSettings(), backend, lambda *a: None, "svc")
    cost = ServiceCost(backend, 8)
    cost.probe = probe
    part.pipeline = SimpleNamespace(scheduler=SimpleNamespace(cost=cost))
    part._plan_budgets()
    return cost.budgets


def test_a_call_may_use_the_budget_less_the_weights_not_less_torchs_cache(monkeypatch):
    budgets = plan(monkeypatch, PeakProbe("torch"), budget=12 * GIB, card=80 * GIB)
    assert budgets.batch_on_gpu and budgets.batch_bytes == 10 * GIB


def test_without_a_plan_the_card_and_without_torch_what_the_backend_says_it_holds(monkeypatch):
    assert plan(monkeypatch, PeakProbe("torch"), budget=None, card=80 * GIB).batch_bytes == 78 * GIB
    assert plan(monkeypatch, PeakProbe("none"), budget=12 * GIB, card=80 * GIB).batch_bytes == 2 * GIB
    assert plan(monkeypatch, None, budget=12 * GIB, card=80 * GIB).batch_bytes == 2 * GIB
    assert not plan(monkeypatch, None, budget=None, card=None).batch_on_gpu   # no card found: host memory

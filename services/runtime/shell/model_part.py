"""A model service's part of the shell: the pipeline (admission, cost model, scheduler,
batching) in front of a backend, and the start that makes it ready.

Start, in this order: the model loads on the GPU worker thread, the thread plan is applied
(again: loading may have imported torch), real warm-up inferences run and measure the
cost curves, the memory is split into budgets, /info is computed, and only then does
/readyz turn 200. /healthz fails while a model call runs past ``inference_timeout_s`` or
the batch loop has stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from common import hostmemory as host_memory
from services.runtime.device import gpu as device_gpu
from services.runtime.device.threads import apply_threads, planned_threads
from services.runtime.pipeline.backend import Backend
from services.runtime.pipeline.budgets import HeldMemory, plan_budgets
from services.runtime.pipeline.metrics import PipelineMetrics
from services.runtime.pipeline.model_routes import ModelPipeline, is_dry_run_scope
from services.runtime.pipeline.scheduler import Scheduler
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.pipeline.warmup import warm_up
from services.runtime.shell import model_info
from services.runtime.shell.app import ServiceShell
from services.runtime.shell.heap import freeze_startup_heap
from services.runtime.shell.memory_watch import MemoryWatch
from services.runtime.shell.part import ServicePart

log = logging.getLogger("onecard.service")

# (app, part, shell) -> None: adds the service's routes (model routes through part.pipeline)
AddRoutes = Callable[[FastAPI, "ModelPart", "ServiceShell"], None]


class ModelPart(ServicePart):
    def __init__(self, name: str, settings: ModelServiceSettings, backend: Backend, add_routes: AddRoutes,
                 title: str, description: str = "", open_paths: frozenset[str] = frozenset()):
        self.name = name
        self.settings = settings
        self.backend = backend
        self._add_routes = add_routes
        self.title, self.description = title, description
        self.open_paths = open_paths
        self.threads = planned_threads()
        self.metrics: PipelineMetrics | None = None
        self.pipeline: ModelPipeline | None = None
        self.load_s: float | None = None
        self.warmup_s: float | None = None
        self.warmup_inferences = 0
        self.frozen_objects = 0
        self.static_info: dict[str, Any] = {}
        self.memory_watch: MemoryWatch | None = None

    @property
    def scheduler(self) -> Scheduler | None:
        return self.pipeline.scheduler if self.pipeline is not None else None

    @property
    def ready(self) -> bool:
        return self.pipeline is not None and self.pipeline.ready

    def bind(self, shell: ServiceShell) -> None:
        self.metrics = PipelineMetrics(shell.metrics.registry)
        self.pipeline = ModelPipeline(self.settings, self.backend, self.metrics, self.threads)

    def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
        self._add_routes(app, self, shell)
        for path, route in self.pipeline.routes.items():
            if route.error_body is not None:
                shell.error_shapes.setdefault(path, route.error_body)

    # ---- start and stop ---------------------------------------------------------------------
    async def start(self, shell: ServiceShell) -> None:
        pipeline, backend, settings = self.pipeline, self.backend, self.settings
        scheduler = Scheduler(backend, settings, self.metrics)
        pipeline.scheduler = scheduler
        worker = scheduler.worker
        apply_threads(self.threads)
        t0 = time.perf_counter()
        await worker.run(backend.load, tracked=False)
        self.load_s = time.perf_counter() - t0
        apply_threads(self.threads)  # again: loading may have imported torch
        t1 = time.perf_counter()
        warm = await warm_up(backend, worker.run, scheduler.cost, settings.warmup_runs, scheduler.max_batch)
        self.warmup_inferences = warm.inferences
        scheduler.limit_batch(warm.max_batch)
        self.warmup_s = time.perf_counter() - t1
        await pipeline.cpu.run(self._plan_budgets)
        self.memory_watch = MemoryWatch(self.name, lambda: scheduler.cost.budgets.service_bytes
                                        if scheduler.cost.budgets is not None else None,
                                        self.metrics.memory_over_budget)
        self.memory_watch.start()
        self.frozen_objects = await pipeline.cpu.run(freeze_startup_heap)  # before ready: it holds the GIL
        self.static_info = await pipeline.cpu.run(model_info.static_info, self)
        scheduler.start()
        pipeline.ready = True
        log.info("%s ready: backend %s loaded in %.2f s, %d warm-up inferences in %.2f s, %d threads, device %s",
                 self.name, backend.name, self.load_s, self.warmup_inferences, self.warmup_s, self.threads,
                 self.static_info.get("device"))

    async def stop(self) -> None:
        pipeline = self.pipeline
        pipeline.ready = False
        if self.memory_watch is not None:
            await self.memory_watch.stop()
        if pipeline.scheduler is not None:
            await pipeline.scheduler.stop()
        pipeline.cpu.shutdown()

    def begin_drain(self) -> None:
        self.pipeline.draining = True

    def _plan_budgets(self) -> None:
        """After warm-up: the service's memory split into budgets (budgets.py), the ledger
        opened. On a GPU a model call's working memory is the card's budget minus what the
        model holds."""
        s = self.settings
        cost = self.scheduler.cost
        total, source = host_memory.service_memory(s.memory_budget_bytes, s.memory_budget_fraction)
        baseline = host_memory.resident_bytes() or 0
        gpu_call = None
        if str(getattr(self.backend, "device", "")) == "cuda":
            # no plan from the supervisor (one service on the card): the whole card; a call
            # that finds it taken is answered 503 out_of_memory, not planned against host memory
            card = device_gpu.budget_bytes() or device_gpu.total_gpu_memory()
            # what the model holds, not what torch keeps cached from the warm-up's biggest
            # batch (on an H200 12.5 GB reserved for 2.1 GB of SD-1.5 weights): a call reuses it
            held_on_card = cost.probe.held_bytes() if cost.probe is not None else None
            if held_on_card is None:
                held_on_card = self._gpu_memory() or 0
            if card:
                gpu_call = max(0, card - held_on_card)
        budgets = plan_budgets(total, baseline, source=source, batch_bytes=s.max_call_memory_bytes,
                               request_bytes=s.max_request_bytes, held_bytes=s.max_held_bytes,
                               gpu_batch_bytes=gpu_call)
        cost.budgets = budgets
        cost.held = HeldMemory(budgets.held_bytes, s.retry_after_s)
        log.info("%s memory: %s", self.name, budgets.snapshot())

    # ---- probes and figures -------------------------------------------------------------------
    def problem(self) -> str | None:
        scheduler = self.scheduler
        return scheduler.problem() if scheduler is not None else None

    def readiness(self) -> str | None:
        return None if self.ready else "loading"

    def stats(self) -> dict[str, Any]:
        p50, p99 = self.metrics.latency_percentiles()
        sched = self.scheduler
        admission = self.pipeline.admission
        return {
            "queue_depth": admission.waiting,
            "in_flight": admission.running,
            "items_pending": sched.pending_items if sched else 0,
            "items_running": sched.in_flight if sched else 0,
            "served": self.metrics.served,
            "errors": self.metrics.errors,
            "refused": admission.refused,
            "latency_p50_ms": None if p50 is None else round(p50 * 1000, 2),
            "latency_p99_ms": None if p99 is None else round(p99 * 1000, 2),
            "gpu_memory_bytes": self._gpu_memory(),
            "dry_runs": self.metrics.dry_runs,
            "batching": sched.batching_stats() if sched else None,
            "call": self.backend.progress(),
            "memory": self.memory_watch.snapshot() if self.memory_watch is not None else None,
        }

    def _gpu_memory(self) -> int | None:
        try:
            return self.backend.gpu_memory_bytes()
        except Exception:  # noqa: BLE001 - a figure, never a reason to fail a probe
            return None

    def before_scrape(self) -> None:
        mem = self._gpu_memory()
        if mem is not None:
            self.metrics.gpu_memory.set(mem)
        self.metrics.queue_depth.set(self.pipeline.admission.waiting)
        if self.scheduler is not None:
            self.metrics.observe_cost(self.scheduler.cost)

    async def info(self) -> dict[str, Any]:
        return {**self.static_info, "ready": self.ready}

    def observe_request(self, route: str, status: int, seconds: float, scope: dict) -> bool:
        if route not in self.pipeline.routes:
            return False
        if is_dry_run_scope(scope):
            self.metrics.observe_dry_run(route, status)  # checked, not served: counted apart
            return True
        self.metrics.observe_model_request(status, seconds)
        return False


def model_service_app(name: str, settings: ModelServiceSettings, backend: Backend, add_routes: AddRoutes,
                      title: str, description: str = "", open_paths: frozenset[str] = frozenset()) -> FastAPI:
    """The app of a model service, as services.runtime.serve runs it."""
    part = ModelPart(name, settings, backend, add_routes, title, description, open_paths)
    return ServiceShell(name, settings, part).app()

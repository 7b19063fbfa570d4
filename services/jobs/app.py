"""The jobs service's app factory (``services.jobs.app:create_app``): the jobs API on the
service shell every onecard service stands on (probes, auth, drain, metrics, /info,
/stats), with the queue's side of the probes."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from services.jobs.api import add_routes
from services.jobs.api_admin import add_admin_routes
from services.jobs.service import JobsService
from services.jobs.settings import JobsSettings
from services.runtime.shell.app import ServiceShell
from services.runtime.shell.part import ServicePart

INFO_LIMITS = ("max_body_bytes", "max_image_bytes", "max_pixels", "max_queued_jobs", "run_timeout_s",
               "max_json_depth", "max_result_bytes", "result_reserve_bytes", "submit_memory_bytes",
               "max_result_streams", "max_list_limit")


class JobsPart(ServicePart):
    title = "onecard jobs"

    def __init__(self, name: str, settings: JobsSettings):
        self.name, self.settings = name, settings
        self.svc: JobsService | None = None
        self.identity: dict[str, Any] = {}

    def bind(self, shell: ServiceShell) -> None:
        self.svc = JobsService(self.name, self.settings, registry=shell.metrics.registry, traces=shell.traces)
        self.identity = shell.identity()

    def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
        app.state.jobs = self.svc
        add_routes(app, self.svc)
        add_admin_routes(app, self.svc)

    async def start(self, shell: ServiceShell) -> None:
        self.svc.begin()  # the queue is reached in the background: /readyz says why not yet

    async def stop(self) -> None:
        await self.svc.shutdown()

    def begin_drain(self) -> None:
        self.svc.begin_drain()  # a draining unit stops taking jobs at once

    def problem(self) -> str | None:
        return self.svc.problem()

    async def readiness(self) -> str | None:
        svc = self.svc
        if not svc.ready:
            return svc.startup_problem or "starting"
        return await svc.queue_problem()

    async def stats(self) -> dict[str, Any]:
        svc = self.svc
        streams = await svc.streams()
        running = svc.metrics.percentiles("running")
        counts = svc.metrics.counts
        return {
            "queue_depth": sum(s["lag"] for s in streams),
            "in_flight": sum(len(c.running) for c in svc.consumers.values()),
            "served": counts["succeeded"],
            "errors": counts["failed"],
            "latency_p50_ms": running["p50_ms"],
            "latency_p99_ms": running["p99_ms"],
            "jobs": {"mode": svc.broker.mode, "node": svc.node, "queue_reachable": svc.queue_reachable,
                     "queue_refuses_writes": svc.broker.refusal, "queue_data_lost_at": svc.registry.data_lost_at,
                     "streams": streams, "stages": svc.stages(), "counts": dict(counts),
                     "submits": {"held_bytes": svc.submits.used, "waiting": svc.submits.waiting,
                                 "waited": svc.submits.waited, "refused": svc.submits.refused},
                     "queue_room": {"waiting": svc.room.waiting, "waited": svc.room.waited,
                                    "refused": svc.room.refused, "client_gone": svc.room.left},
                     "result_streams": {"reading": svc.stream_slots.used, "waiting": svc.stream_slots.waiting,
                                        "waited": svc.stream_slots.waited, "refused": svc.stream_slots.refused},
                     "long_polls_waiting": svc.polls_waiting},
        }

    async def before_scrape(self) -> None:
        svc = self.svc
        svc.metrics.snapshot(await svc.streams(), svc.broker.refusals, svc.broker.refusal)

    async def info(self) -> dict[str, Any]:
        svc, cfg = self.svc, self.settings
        try:
            known = sorted(await svc.known_models()) if svc.ready else []
        except Exception:  # noqa: BLE001 - /info must answer while the queue is away
            known = []
        return {
            "service": self.name, "node": svc.node, "ready": svc.ready, **self.identity,
            "queue": svc.broker.describe(),
            "model_labels": sorted(svc.consumers),
            "targets": [{"name": t.name, "url": t.url, "model_label": t.label or None, "routes": t.routes,
                         "max_in_flight": t.max_in_flight, "dry_run": t.dry_run_supported, "up": t.up}
                        for t in svc.targets],
            "known_models": known,
            "registry": svc.registry.describe(),
            "limits": {k: getattr(cfg, k) for k in INFO_LIMITS},
        }


def create_app(settings: dict[str, Any]) -> FastAPI:
    cfg = JobsSettings.model_validate(settings)
    name = os.environ.get("ONECARD_SERVICE_NAME", "jobs")
    return ServiceShell(name, cfg, JobsPart(name, cfg)).app()

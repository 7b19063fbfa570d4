"""What a service adds to the shell: its routes, its start and stop, and its side of the
probes. The shell (services.runtime.shell.app) does everything else the same way for every
service. A model service's part is services.runtime.shell.model_part.ModelPart; the jobs
service's is services.jobs.app.JobsPart.

Probe hooks may be plain functions or coroutine functions. A plain one is called from the
probe listener's thread as well as from the event loop, so it only reads (no awaiting, no
locks held for long); a coroutine function runs on the service's event loop, and from the
probe thread the shell waits for it at most a few seconds (a loop that does not answer
makes the probe fail, which is what it should say).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from services.runtime.shell.app import ServiceShell


class ServicePart:
    title = "onecard service"
    description = ""
    # paths a client may call without credentials (the probes and the API documents always may)
    open_paths: frozenset[str] = frozenset()

    def bind(self, shell: ServiceShell) -> None:
        """The shell this part belongs to is made (its registry exists): build what needs it."""

    def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
        """The service's own routes."""

    async def start(self, shell: ServiceShell) -> None:
        """Load and warm up (raise: the service does not start, the process exits 78)."""

    async def stop(self) -> None:
        """Free what start took; the drain of in-flight requests is over when this runs."""

    def begin_drain(self) -> None:
        """The stop signal arrived (called on the event loop): take no new work."""

    def problem(self) -> str | None:
        """Why /healthz must fail besides a stalled event loop (a stuck model call), or None."""
        return None

    def readiness(self) -> str | None:
        """Why the service is not ready yet ("loading"), or None when it is."""
        return None

    def stats(self) -> dict[str, Any]:
        """The figures of /stats (queue_depth, in_flight, served, errors, latency_p50_ms, ...)."""
        return {}

    def before_scrape(self) -> None:
        """Bring the figures the registry does not keep current by itself up to date."""

    async def info(self) -> dict[str, Any]:
        """/info: what the service runs."""
        return {}

    def observe_request(self, route: str, status: int, seconds: float, scope: dict) -> bool:
        """One request answered (not a probe). True: it is counted apart (a dry run), not in
        onecard_requests."""
        return False

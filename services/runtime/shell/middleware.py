"""Every request's way through the shell, as pure ASGI (no task per request): the instance
header on every answer, credentials, the request's metrics, one log line a request."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from services.runtime.errors import ApiError

if TYPE_CHECKING:
    from services.runtime.shell.app import ServiceShell

log = logging.getLogger("onecard.service")
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/stats"})


class ShellMiddleware:
    def __init__(self, app, shell: ServiceShell):
        self.app, self.shell = app, shell
        self.instance = shell.instance.encode("latin-1") if shell.instance else None
        self.log_requests = os.environ.get("ONECARD_ACCESS_LOG", "0") == "1"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        timing = [b""]
        instance = self.instance

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                for k, v in message.get("headers", ()):
                    if k == b"server-timing":
                        timing[0] = v
                if instance is not None:  # the supervisor knows whom it reached, on every answer
                    message = {**message, "headers": [*message.get("headers", ()), (b"x-onecard-instance", instance)]}
            await send(message)

        path = scope["path"]
        if path in PROBE_PATHS:
            return await self.app(scope, receive, send_wrapper)
        t0 = time.perf_counter()
        credentials = self.shell.credentials
        if credentials.required and path not in self.shell.open_paths and not credentials.check(scope):
            exc = ApiError(401, "unauthorized", credentials.hint(), credentials.challenge())
            await self.shell.error_answer(exc, path)(scope, receive, send_wrapper)
            self._observe(scope, 401, t0, b"")
            return
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._observe(scope, status[0], t0, timing[0])

    def _observe(self, scope, status: int, t0: float, timing: bytes) -> None:
        route = scope.get("route")
        label = getattr(route, "path", None) or "unmatched"
        dt = time.perf_counter() - t0
        if not self.shell.part.observe_request(label, status, dt, scope):
            self.shell.metrics.observe_request(label, status, dt)
        if self.log_requests:
            log.info("%s %s %d %.1fms %s", scope["method"], scope["path"], status, dt * 1000, timing.decode())

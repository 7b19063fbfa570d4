"""Credential guessing is counted and slowed down, per client address.

A request that presents a credential (``Authorization`` or ``X-API-Key``) and is
answered 401 is a failure of its client address. After ``auth_max_failures`` of them
within ``auth_failure_window_s``, that address's requests that present a credential are
answered 429 with ``Retry-After`` (the time until its oldest failure leaves the window)
without being checked at all: a right guess during the lockout is not told apart from
a wrong one. Requests without a credential are not counted (a client asking without
credentials first, then answering the 401's challenge, is the normal flow) and are
never refused here: without a credential there is nothing to guess.

The gate wraps the whole app, outside any service's own auth, so it watches whatever
answers 401 (the runtime's credentials, the jobs service's key) and the probes are
never refused. It keeps a bounded table: at most ``MAX_CLIENTS`` addresses, the least
recently failed forgotten first.
"""

from __future__ import annotations

import collections
import json
import math
import time
from collections.abc import Callable

MAX_CLIENTS = 4096
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key"})
NEVER_LIMITED = frozenset({"/healthz", "/readyz", "/metrics", "/stats"})


class FailureLimiter:
    def __init__(self, max_failures: int, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS):
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self.max_clients = max_clients
        self._failures: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self.failures_total = 0
        self.refused_total = 0

    @property
    def enabled(self) -> bool:
        return self.max_failures > 0

    def retry_after(self, client: str) -> float | None:
        """Seconds before ``client`` may present a credential again, or None."""
        times = self._failures.get(client)
        if not self.enabled or times is None or len(times) < self.max_failures:
            return None
        wait = times[0] + self.window_s - self.clock()
        return wait if wait > 0 else None

    def record_failure(self, client: str) -> None:
        self.failures_total += 1
        if not self.enabled:
            return
        times = self._failures.pop(client, None)
        if times is None:
            times = collections.deque(maxlen=self.max_failures)
        times.append(self.clock())
        self._failures[client] = times  # most recent last
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)


def _presents_credential(scope) -> bool:
    return any(name in CREDENTIAL_HEADERS for name, _ in scope.get("headers", ()))


def _client(scope) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


class AuthFailureGate:
    """Pure ASGI: 429 for a locked-out address that presents a credential; every 401 to
    one that presented a credential is a failure."""

    def __init__(self, app, limiter: FailureLimiter):
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["path"] in NEVER_LIMITED or not self.limiter.enabled
                or not _presents_credential(scope)):
            return await self.app(scope, receive, send)
        client = _client(scope)
        wait = self.limiter.retry_after(client)
        if wait is not None:
            self.limiter.refused_total += 1
            await _too_many_failures(send, math.ceil(wait), self.limiter)
            return

        async def watch(message):
            if message["type"] == "http.response.start" and message["status"] == 401:
                self.limiter.record_failure(client)
            await send(message)

        await self.app(scope, receive, watch)


async def _too_many_failures(send, retry_after: int, limiter: FailureLimiter) -> None:
    message = (f"over {limiter.max_failures} failed credential checks from this address within "
               f"{limiter.window_s:g} s; retry after {retry_after} s")
    # the envelope, and `detail` for webui clients, which read that field
    body = json.dumps({"error": {"code": "too_many_auth_failures", "message": message},
                       "detail": message}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry_after).encode())]})
    await send({"type": "http.response.body", "body": body})

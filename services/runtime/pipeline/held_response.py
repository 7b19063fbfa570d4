"""A model route's answer, charged to the memory ledger until it is sent."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from services.runtime.pipeline.budgets import Charge


class HeldResponse(Response):
    """A response whose bytes stay charged to the memory ledger until they are sent (or the
    connection is gone): an answer a client does not read still counts. A body given as a
    list of parts is sent part after part (no joined copy)."""

    def __init__(self, content: bytes | list[bytes], *args: Any, charge: Charge | None = None, **kwargs: Any):
        self._parts = None if isinstance(content, bytes) else content
        super().__init__(content if isinstance(content, bytes) else b"", *args, **kwargs)
        if self._parts is not None:
            self.headers["content-length"] = str(sum(map(len, self._parts)))
        self._charge = charge

    async def __call__(self, scope, receive, send) -> None:
        try:
            if self._parts is None:
                await super().__call__(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") != "HEAD":
                for n, part in enumerate(self._parts):
                    await send({"type": "http.response.body", "body": part, "more_body": n < len(self._parts) - 1})
            else:
                await send({"type": "http.response.body", "body": b""})
        finally:
            if self._charge is not None:
                self._charge.close()

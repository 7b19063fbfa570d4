"""A model route's answer, charged to the memory ledger until it is sent."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from services.runtime.pipeline.budgets import Charge

# An answer is handed to the transport this much at a time, as views of its bytes. Handed
# whole, the event loop copied what the socket did not take at once twice (asyncio's
# `data[n:]`, then into its buffer): a 36 MP PNG answer held it 20-90 ms, and img2img's
# /healthz p99 was 25-28 ms under 6 clients sending 36 MP pictures (helper-51)
PIECE_BYTES = 1 << 20


def _pieces(parts: list[bytes]) -> list[memoryview]:
    out = []
    for part in parts:
        view = memoryview(part).cast("B")
        out += [view[at:at + PIECE_BYTES] for at in range(0, len(view), PIECE_BYTES)] or [view]
    return out


class HeldResponse(Response):
    """A response whose bytes stay charged to the memory ledger until they are sent (or the
    connection is gone): an answer a client does not read still counts. The body (bytes, or
    a list of parts: no joined copy) is sent PIECE_BYTES at a time, each piece a view."""

    def __init__(self, content: bytes | list[bytes], *args: Any, charge: Charge | None = None, **kwargs: Any):
        self._parts = None if isinstance(content, bytes) else content
        super().__init__(content if isinstance(content, bytes) else b"", *args, **kwargs)
        if self._parts is not None:
            self.headers["content-length"] = str(sum(map(len, self._parts)))
        self._charge = charge

    async def __call__(self, scope, receive, send) -> None:
        try:
            parts = self._parts if self._parts is not None else [self.body]
            if self._parts is None and len(self.body) <= PIECE_BYTES:
                await super().__call__(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") != "HEAD":
                pieces = _pieces(parts)
                for n, piece in enumerate(pieces):
                    await send({"type": "http.response.body", "body": piece, "more_body": n < len(pieces) - 1})
            else:
                await send({"type": "http.response.body", "body": b""})
        finally:
            if self._charge is not None:
                self._charge.close()

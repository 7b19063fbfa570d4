"""Request bodies read within limits on the event loop, and the query string.

Reading only moves bytes: 413 as soon as the size is known to be over the limit, declared
or chunked, and the memory ledger is told what the body will hold before it is read.
Parsing is CPU work and runs off the loop (services.runtime.codecs.forms).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from services.runtime.errors import ApiError, ClientGone


def query_params(request: Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in request.query_params.multi_items():
        if k in out:
            raise ApiError(422, "invalid_parameter", f"{k}: given more than once in the query string")
        out[k] = v
    return out


HOLD_STEP = 1 << 20  # a chunked body's holding is raised a megabyte at a time
# A body refused unread keeps arriving, and the edge closes a connection whose body runs far
# past the limit: the client is told, so that it does not send its next request on it.
CLOSE = {"Connection": "close"}


async def read_body(request: Request, max_bytes: int, hold: Callable[[int], None] | None = None) -> bytes:
    """The whole body, within `max_bytes`. `hold(n)` is told how much is held before it is
    read (the declared length) or as it grows (chunked): it raises to refuse the rest."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "bad_request", "invalid Content-Length")
        if int(declared) > max_bytes:
            raise ApiError(413, "body_too_large", f"body of {declared} bytes is over the limit of {max_bytes}",
                           CLOSE)
        if hold is not None:
            hold(int(declared))
    held = int(declared) if declared is not None else 0
    buf = bytearray()
    try:
        async for chunk in request.stream():
            if len(buf) + len(chunk) > max_bytes:
                raise ApiError(413, "body_too_large", f"body is over the limit of {max_bytes} bytes", CLOSE)
            buf += chunk
            if hold is not None and len(buf) > held:
                held = min(max_bytes, len(buf) + HOLD_STEP)
                hold(held)
    except ClientDisconnect:  # left mid-upload (or cut at the body deadline): nobody to answer
        raise ClientGone() from None
    return bytes(buf)

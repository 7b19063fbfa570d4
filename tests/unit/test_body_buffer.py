"""A request body is read into the bytes object it ends up as: no second copy of a big body
(a 15 MB copy held the GIL and the probes waited; it also doubled the memory the body held)."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import pytest
from starlette.requests import Request

from services.runtime.edge.body import DIRECT_MIN_BYTES, BodyBuffer, read_body
from services.runtime.errors import ApiError

PIECE = 64 * 1024


def request_of(pieces: list[bytes], declared: int | None) -> Request:
    headers = [(b"content-type", b"image/png")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}, receive)


@pytest.mark.parametrize("declared", [True, False])  # Content-Length, or chunked
def test_a_body_comes_back_whole_as_bytes(declared):
    data = os.urandom(3 * DIRECT_MIN_BYTES + 12345)
    pieces = [data[i:i + PIECE] for i in range(0, len(data), PIECE)]
    held: list[int] = []
    got = asyncio.run(read_body(request_of(pieces, len(data) if declared else None), 64 << 20, held.append))
    assert type(got) is bytes and got == data and hash(got) == hash(bytes(data))
    assert held == sorted(held) and (held[-1] == len(data) if declared else held[-1] >= len(data))


def test_a_big_body_is_never_held_twice():
    size = 16 << 20
    request = request_of([os.urandom(PIECE)] * (size // PIECE), size)

    async def read() -> tuple[int, int]:
        tracemalloc.reset_peak()
        got = await read_body(request, 64 << 20)
        return len(got), tracemalloc.get_traced_memory()[1]
    tracemalloc.start()
    try:
        got, peak = asyncio.run(read())
    finally:
        tracemalloc.stop()
    assert got == size
    assert peak < 1.25 * size, f"reading a {size >> 20} MiB body peaked at {peak / 2**20:.1f} MiB"


def test_a_body_that_is_not_its_declared_length_is_refused():
    longer = BodyBuffer(DIRECT_MIN_BYTES)
    longer.add(b"x" * DIRECT_MIN_BYTES)
    with pytest.raises(ApiError) as err:
        longer.add(b"y")
    assert err.value.status == 400
    shorter = BodyBuffer(DIRECT_MIN_BYTES)
    shorter.add(b"x" * (DIRECT_MIN_BYTES - 1))
    with pytest.raises(ApiError) as err:
        asyncio.run(shorter.take())
    assert err.value.status == 400

"""A JSON body refused for its items gets its answer from the document's start (400
json_too_deep when that nests too deep, else 413 json_too_complex), whatever the copier
thread has copied yet: the same body, the same answer. The start was read back from the
bytes object the pieces are copied into, where a piece still queued for the copier was a
hole, and the depth was taken from the refused piece alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.requests import Request

from services.runtime.codecs import copy_behind
from services.runtime.edge.body import DIRECT_MIN_BYTES, read_body
from services.runtime.errors import ApiError


def json_request(pieces: list[bytes], declared: int) -> Request:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(declared).encode())]
    messages = [{"type": "http.request", "body": p, "more_body": True} for p in pieces]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}, receive)


# a deep start in a piece big enough for the copier thread, then a piece of many items
DEEP_START = b"[" * 64 + b'"' + b"A" * 70_000 + b'",'
MANY_ITEMS = b"1," * 2_000
# a string left open in a big piece, and brackets inside it: a shallow document
OPEN_STRING = b'{"a": "' + b"A" * 70_000
BRACKETS_IN_THE_STRING = b"[" * 2_000 + b'", "b": 1}'


@pytest.mark.parametrize("start,rest,status,code", [(DEEP_START, MANY_ITEMS, 400, "json_too_deep"),
                                                    (OPEN_STRING, BRACKETS_IN_THE_STRING, 413, "json_too_complex")])
def test_the_answer_comes_from_the_documents_start_while_its_copy_is_queued(monkeypatch, start, rest, status, code):
    release = threading.Event()
    real = copy_behind.copy_into

    def held_copy(address, piece):
        release.wait(10)
        real(address, piece)
    monkeypatch.setattr(copy_behind, "copy_into", held_copy)
    try:
        with pytest.raises(ApiError) as err:
            asyncio.run(read_body(json_request([start, rest], DIRECT_MIN_BYTES), 64 << 20,
                                  max_json_items=1_000, max_json_depth=32))
    finally:
        release.set()
    assert (err.value.status, err.value.code) == (status, code)

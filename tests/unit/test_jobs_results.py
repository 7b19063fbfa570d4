"""A result read in pieces: a poll at the moment the result expires gets a whole answer
without it, never one cut short of its Content-Length."""

from __future__ import annotations

import asyncio
import base64
import json

from services.jobs.results import PIECE, StreamedBody, first_piece, inline_parts


def run(coro):
    return asyncio.run(coro)


def reader(store: dict[str, bytes]):
    async def read(start: int, n: int) -> bytes:
        return store.get("r", b"")[start:start + n]
    return read


def test_a_result_that_expired_since_its_size_was_read_has_no_first_piece():
    store = {"r": b"x" * 1000}
    read = reader(store)
    assert run(first_piece(read, 1000)) == b"x" * 1000
    store.clear()  # the store's TTL ran out between the size and the first read
    assert run(first_piece(read, 1000)) is None


def test_a_streamed_body_is_exactly_its_content_length_and_valid_json():
    data = bytes(range(256)) * ((2 * PIECE + 777) // 256)
    store = {"r": data}
    read = reader(store)
    view = {"id": "a" * 32, "state": "succeeded"}
    head, tail, encode = inline_parts(view, {"result_type": "image/png"}, len(data))
    first = run(first_piece(read, len(data)))
    sent: list[dict] = []

    async def cpu(_cost, fn, *args):
        return fn(*args)

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    body = StreamedBody(head, tail, len(data), first, read, encode, "application/json", cpu, 5.0)
    run(body(None, receive, send))
    length = int(dict(sent[0]["headers"])[b"content-length"])
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    assert len(payload) == length
    doc = json.loads(payload)
    assert base64.b64decode(doc["result"]["image"]) == data and doc["state"] == "succeeded"


def test_the_heap_is_trimmed_once_when_many_results_at_once_have_all_ended():
    """700 readers that never read left the jobs service 150 MiB above its start: their pieces
    came from malloc's heap (under its mmap threshold) and stayed in its arenas."""
    from services.jobs.results import LiveStreams
    trims = []
    live = LiveStreams(lambda: trims.append(1))
    for _ in range(LiveStreams.TRIM_AFTER - 1):
        live.begin()
    for _ in range(LiveStreams.TRIM_AFTER - 1):
        live.end()
    assert trims == []  # a few at once: nothing worth a trim
    for _ in range(LiveStreams.TRIM_AFTER):
        live.begin()
    for _ in range(LiveStreams.TRIM_AFTER - 1):
        live.end()
    assert trims == []  # one still being sent
    live.end()
    assert trims == [1]
    live.begin()
    live.end()
    assert trims == [1]  # once per peak

"""HeldResponse hands a big answer to the server a piece at a time, each a view of its bytes:
handed whole, asyncio's transport copied what the socket did not take at once twice on the
event loop (a 36 MP PNG answer: 20-90 ms; img2img's /healthz p99 25-28 ms under 6 clients
sending 36 MP pictures, 8.6-12.6 ms in pieces)."""

from __future__ import annotations

import asyncio
import os

from services.runtime.pipeline.held_response import PIECE_BYTES, HeldResponse


def _sent(response: HeldResponse, method: str = "POST") -> list[dict]:
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}
    asyncio.run(response(scope={"type": "http", "method": method}, receive=receive, send=send))
    return messages


def test_a_big_answer_goes_in_pieces_that_are_views_of_its_bytes():
    body = os.urandom(3 * PIECE_BYTES + 12345)
    messages = _sent(HeldResponse(body, media_type="image/png"))
    start, *pieces = messages
    assert dict(start["headers"])[b"content-length"] == str(len(body)).encode()
    assert len(pieces) == 4 and all(len(m["body"]) <= PIECE_BYTES for m in pieces)
    assert all(isinstance(m["body"], memoryview) and m["body"].obj is body for m in pieces)  # no copy
    assert [m["more_body"] for m in pieces] == [True, True, True, False]
    assert b"".join(bytes(m["body"]) for m in pieces) == body


def test_parts_are_cut_in_pieces_too_and_a_small_answer_goes_whole():
    parts = [os.urandom(PIECE_BYTES + 1), b"", os.urandom(10)]
    pieces = _sent(HeldResponse(parts, media_type="application/json"))[1:]
    assert b"".join(bytes(m["body"]) for m in pieces) == b"".join(parts)
    assert max(len(m["body"]) for m in pieces) <= PIECE_BYTES and not pieces[-1]["more_body"]
    small = _sent(HeldResponse(b"{}", media_type="application/json"))
    assert [m["type"] for m in small] == ["http.response.start", "http.response.body"]
    assert small[1]["body"] == b"{}"


def test_a_head_request_gets_no_body_and_the_charge_is_closed():
    class Charge:
        closed = 0

        def close(self) -> None:
            Charge.closed += 1
    messages = _sent(HeldResponse(os.urandom(2 * PIECE_BYTES), media_type="image/png", charge=Charge()), "HEAD")
    assert [m.get("body") for m in messages[1:]] == [b""] and Charge.closed == 1

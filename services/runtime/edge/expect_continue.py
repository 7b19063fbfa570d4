"""A request cycle's ``Expect: 100-continue``, as the guarded protocol (protocol.py) needs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def close_if_refused_before_continue(cycle: Any) -> None:
    """A client that sent ``Expect: 100-continue`` holds its body back until the 100;
    answered without it (413, 401), its connection cannot carry another request (the body
    it announced is still due): say ``Connection: close`` and close."""
    send = cycle.send

    async def send_then_close(message):
        if message["type"] == "http.response.start" and cycle.waiting_for_100_continue and cycle.more_body:
            cycle.keep_alive = False
        await send(message)
    cycle.send = send_then_close


def stamp_the_continue(cycle: Any, on_continue: Callable[[], None]) -> None:
    """uvicorn writes the 100 Continue when the app first reads the body, maybe long after
    the head (the jobs service reads a submit once it is admitted): ``on_continue`` is
    called then, before it is written."""
    receive = cycle.receive

    async def receive_after_continue():
        if cycle.waiting_for_100_continue:
            on_continue()
        return await receive()
    cycle.receive = receive_after_continue

"""Connections taken off a listening socket by hand, a batch a turn of the event loop, in
place of asyncio's server (which made a task and a transport of each before anyone could
look at it): the supervisor's probe port and the services' door."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from typing import Any

OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_S = 0.1  # out of descriptors or buffers: accepting pauses this long (asyncio: 1 s)


def accept_one(listener: socket.socket) -> socket.socket | None:
    """The next connection waiting on a non-blocking listener, non-blocking itself; None when
    none waits, or when one was aborted before it was taken (the next, next turn). Raises
    OSError when out of descriptors or buffers: the caller pauses accepting (pause)."""
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        if exc.errno in OUT_OF_RESOURCES:
            raise
        return None
    conn.setblocking(False)
    return conn


def pause(loop: asyncio.AbstractEventLoop, listener: socket.socket, reader: Callable[..., Any], *args: Any,
          resumed: Callable[[], None] | None = None) -> None:
    """Out of descriptors the listener stays readable: asked again at every turn, the loop
    would spin on it (24 745 calls in 0.3 s). Its reader comes off for RETRY_S, then back,
    unless the listener was closed meanwhile; `resumed` is called then either way."""
    loop.remove_reader(listener.fileno())

    def resume() -> None:
        if resumed is not None:
            resumed()
        if listener.fileno() >= 0:
            loop.add_reader(listener.fileno(), reader, *args)
    loop.call_later(RETRY_S, resume)

"""The children's output: every pipe read to its end, each line tagged with its source and
kept in the child's tail (the last lines, for messages that say why it failed).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from supervisor.child import ChildProcess
from supervisor.logs import LineSplitter

if TYPE_CHECKING:
    from supervisor.unit import Supervisor


class ChildOutput:
    def __init__(self, sup: "Supervisor"):
        self.sup = sup

    def attach(self, tag: str, fd: int, child: ChildProcess | None = None, tail: Any = None) -> asyncio.Future:
        """Read a child's pipe to its end, tagging each line; the future is done at EOF."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        sink = tail if tail is not None else (child.tail if child is not None else None)
        log = self.sup.log

        def on_lines(texts: list[str]) -> None:
            if sink is not None:
                sink.extend(texts)
            log.lines(tag, texts)

        def on_eof() -> None:
            if child is not None:
                child.output_open = False
            if not done.done():
                done.set_result(None)

        if child is not None:
            child.output_open = True
        pipe = open(fd, "rb", buffering=0, closefd=True)
        self.sup.spawn_task(loop.connect_read_pipe(lambda: LineSplitter(on_lines, on_eof), pipe))
        return done

    async def drain(self, events: asyncio.Queue, on_sigchld: Callable[[], None]) -> None:
        """Wait (bounded) for every child's last lines, reaping meanwhile."""
        sup = self.sup
        deadline = sup.clock.now() + 2.0
        while any(c.output_open for c in sup.children):
            left = deadline - sup.clock.now()
            if left <= 0:
                break
            try:
                event = await asyncio.wait_for(events.get(), min(left, 0.1))
            except asyncio.TimeoutError:
                continue
            if event[0] == "sigchld":
                on_sigchld()

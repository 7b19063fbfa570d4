"""The children's output: every pipe read to its end, each line tagged with its source and
kept in the child's tail (the last lines, for messages that say why it failed); a line that
repeats the child's previous one reaches the log once per window (log_repeats).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from supervisor.driver.child import ChildProcess
from supervisor.driver.events import ChildrenChanged
from supervisor.driver.log_repeats import RepeatedLines
from supervisor.driver.logs import LineSplitter, Tail
from supervisor.driver.port import DriverPort

LAST_LINES_WAIT_S = 2.0  # at the end: how long the children's last lines may take to arrive


class ChildOutput:
    def __init__(self, port: DriverPort):
        self.port = port

    def attach(self, tag: str, fd: int, child: ChildProcess | None = None, tail: Tail | None = None) -> asyncio.Future:
        """Read a child's pipe to its end, tagging each line; the future is done at EOF."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        sink = tail if tail is not None else (child.tail if child is not None else None)
        log = self.port.log
        repeats = RepeatedLines(self.port.clock.now)

        def on_lines(texts: list[str]) -> None:
            if sink is not None:
                sink.extend(texts)  # the tail keeps every line: the last ones say why a child failed
            written = repeats.filter(texts)
            if written:
                log.lines(tag, written)

        def on_eof() -> None:
            if child is not None:
                child.output_open = False
            if not done.done():
                done.set_result(None)

        if child is not None:
            child.output_open = True
        pipe = open(fd, "rb", buffering=0, closefd=True)  # the read pipe transport owns it and closes it
        self.port.start_task(loop.connect_read_pipe(lambda: LineSplitter(on_lines, on_eof), pipe))
        return done

    async def drain(self, events: asyncio.Queue, reap: Callable[[], None]) -> None:
        """Wait (bounded) for every child's last lines, reaping meanwhile."""
        clock = self.port.clock
        deadline = clock.now() + LAST_LINES_WAIT_S
        while any(c.output_open for c in self.port.children):
            left = deadline - clock.now()
            if left <= 0:
                break
            try:
                event = await asyncio.wait_for(events.get(), min(left, 0.1))
            except TimeoutError:
                continue
            if isinstance(event, ChildrenChanged):
                reap()

"""The narrow port through which the driver's helpers reach it.

The service watch, the descendants, the MPS child, the children's output and the
endpoints each get this, never the driver: they may post an event (also from a worker
thread), start a task that the driver cancels at its end, log (once per key and 10 s for
what may repeat), read the clock and the settings, use the OS layer, and look at the
unit (is it stopping, which children). Whatever they want changed in the unit's state
goes through an event, which the driver applies on its one loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from supervisor.config.settings import SupervisorSettings
from supervisor.driver.child import ChildProcess
from supervisor.driver.logs import LogSink
from supervisor.policy.unit_lifecycle import UnitLifecycle
from supervisor.system.clock import Clock
from supervisor.system.os_layer import OsLayer

LOG_REPEAT_S = 10.0  # a line that may repeat (a signal storm, a probe flood) at most this often


class DriverPort:
    def __init__(self, settings: SupervisorSettings, system: OsLayer, clock: Clock, log: LogSink,
                 unit: UnitLifecycle, children: list[ChildProcess]):
        self.settings = settings
        self.system = system
        self.clock = clock
        self.log = log
        self.children = children
        self._unit = unit
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None   # set when the driver's loop runs
        self._tasks: set[asyncio.Task] = set()
        self._last_logged: dict[str, float] = {}

    # ---- a look at the unit -----------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._unit.stopping

    @property
    def stop_reason(self) -> str:
        return self._unit.reason

    # ---- events and tasks ---------------------------------------------------------------------
    def post(self, event: object) -> None:
        """Enqueue an event for the driver's loop (from the loop: a handler, a task, a timer)."""
        self.events.put_nowait(event)

    def post_from_thread(self, event: object) -> None:
        """The same from a worker thread (the sampler's)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.post, event)

    def start_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A task of the unit: cancelled when the driver's loop ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ---- logs ---------------------------------------------------------------------------------
    def log_once(self, key: str, level: str, text: str) -> None:
        """One line per `key` every LOG_REPEAT_S: a storm of the same event costs one line."""
        now = self.clock.now()
        last = self._last_logged.get(key)
        if last is not None and now - last < LOG_REPEAT_S:
            return
        self._last_logged[key] = now
        self.log.line("onecard", text, level)

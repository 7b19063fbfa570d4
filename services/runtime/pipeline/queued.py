"""What waits in the scheduler's queue: a request's items (a QueuedRequest, compared by
identity, with its deadline, its admission ticket and its results) and each of its items
(a QueuedItem), which batches take one by one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from services.runtime.pipeline.admission import Ticket


@dataclass(eq=False)
class QueuedRequest:
    """One request's items on their way through the queue (compared by identity)."""
    items: list[Any]
    key: Hashable
    deadline: float
    enqueued: float
    future: asyncio.Future
    ticket: Ticket | None = None
    results: list[Any] = field(default_factory=list)
    remaining: int = 0
    started_at: float | None = None
    infer_s: float = 0.0
    abandoned: bool = False          # nobody waits for the result any more
    calls: list[tuple[float, float, int]] | None = None  # traced: each model call's start, end, batch size

    def cancel_items(self) -> None:
        self.abandoned = True
        for item in self.items:
            event = getattr(item, "cancel", None)
            if isinstance(event, threading.Event):
                event.set()

    @property
    def cancellable(self) -> bool:
        return all(isinstance(getattr(i, "cancel", None), threading.Event) for i in self.items)


@dataclass(eq=False)
class QueuedItem:
    """One of a request's items in the queue: its request, its place in it, its pixels."""
    job: QueuedRequest
    index: int
    pixels: int = 0

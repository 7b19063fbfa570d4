"""One supervised service process: its plan, its state and what we have seen of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from supervisor.logs import Tail
from supervisor.plan import ServicePlan


class State(str, enum.Enum):
    PENDING = "pending"      # not spawned yet
    STARTING = "starting"    # spawned, /readyz not yet 200
    READY = "ready"          # /readyz 200
    NOT_READY = "not_ready"  # was ready, /readyz no longer 200 (still alive)
    STOPPING = "stopping"    # SIGTERM sent, waiting for it to exit
    EXITED = "exited"


@dataclass
class ChildProcess:
    plan: ServicePlan
    state: State = State.PENDING
    pid: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None        # 128+N when signal N killed it
    liveness_misses: int = 0
    last_probe_error: str = ""
    output_open: bool = False
    killed: bool = False                # we had to SIGKILL it
    tail: Tail = field(default_factory=Tail)
    stats: dict[str, Any] = field(default_factory=dict)  # what the service reports on /stats
    cpu_percent: float | None = None
    cpu_seconds: float | None = None
    rss_bytes: int | None = None

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def alive(self) -> bool:
        return self.pid is not None and self.state != State.EXITED

    def uptime(self, now: float) -> float | None:
        if self.started_at is None:
            return None
        end = self.exited_at if self.exited_at is not None else now
        return max(0.0, end - self.started_at)

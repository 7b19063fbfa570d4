"""One supervised child (a service or the MPS control daemon): its plan, its state
machine and what we have seen of it. The state changes only through `fire`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from supervisor.driver.logs import Tail
from supervisor.policy.child_lifecycle import (
    PROBED_STATES,
    SERVICE,
    ChildEvent,
    ChildRules,
    ChildState,
    is_alive,
    next_state,
)
from supervisor.policy.plan import ServicePlan


@dataclass
class ChildProcess:
    plan: ServicePlan
    rules: ChildRules = SERVICE
    state: ChildState = ChildState.PENDING
    pid: int | None = None
    token: str = ""                     # ONECARD_INSTANCE_TOKEN of this spawn
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
    jobs: dict[str, Any] | None = None  # the service's /stats "jobs" section, passed through
    batching: dict[str, Any] | None = None  # a model service's batching and cost figures (service_watch)
    history: list[tuple[ChildState, ChildEvent, ChildState]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def alive(self) -> bool:
        return self.pid is not None and is_alive(self.state)

    @property
    def probing(self) -> bool:
        return self.state in PROBED_STATES

    def fire(self, event: ChildEvent) -> ChildState:
        old = self.state
        self.state = next_state(old, event)
        if old != self.state:
            self.history.append((old, event, self.state))
        return self.state

    def uptime(self, now: float) -> float | None:
        if self.started_at is None:
            return None
        end = self.exited_at if self.exited_at is not None else now
        return max(0.0, end - self.started_at)

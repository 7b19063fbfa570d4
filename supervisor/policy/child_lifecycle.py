"""A supervised child's lifecycle as a table: its states, the events that move it, and
what its death means for the unit. Pure: no I/O, no clock, no asyncio.

Every child (a service, the MPS control daemon) moves through the same CHILD_TABLE; what
its unexpected exit means is its `ChildRules`. A pair missing from the table is a bug,
not an event to ignore silently: the table is complete and a test checks it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from supervisor.policy.exit_codes import EXIT_MPS_DIED, EXIT_SERVICE_STOPPED


class ChildState(str, enum.Enum):
    PENDING = "pending"      # not started yet
    STARTING = "starting"    # started, not ready yet
    READY = "ready"          # answering /readyz 200 (MPS: control socket up)
    NOT_READY = "not_ready"  # was ready, /readyz no longer 200 (still alive)
    STOPPING = "stopping"    # told to stop (SIGTERM, MPS quit), not gone yet
    LINGERING = "lingering"  # its main process was reaped; processes it started still run
    EXITED = "exited"        # reaped, and nothing it started is left


class ChildEvent(str, enum.Enum):
    STARTED = "started"        # spawned (MPS: the daemon adopted)
    READY_OK = "ready_ok"      # /readyz 200 from our child
    READY_LOST = "ready_lost"  # /readyz not 200, no answer, or an answer that is not our child's
    TERM = "term"              # we told it to stop
    EXITED = "exited"          # its main process's exit was reaped
    EMPTIED = "emptied"        # no process it started is left (its cgroup or tree is empty)


# (state, event) -> the next state; one row per state, the events in ChildEvent's order.
CHILD_TABLE: dict[tuple[ChildState, ChildEvent], ChildState] = {
    (ChildState.PENDING, ChildEvent.STARTED): ChildState.STARTING,
    (ChildState.PENDING, ChildEvent.READY_OK): ChildState.PENDING,       # a late probe answer: nothing runs yet
    (ChildState.PENDING, ChildEvent.READY_LOST): ChildState.PENDING,
    (ChildState.PENDING, ChildEvent.TERM): ChildState.EXITED,            # never started: nothing to wait for
    (ChildState.PENDING, ChildEvent.EXITED): ChildState.EXITED,
    (ChildState.PENDING, ChildEvent.EMPTIED): ChildState.PENDING,
    (ChildState.STARTING, ChildEvent.STARTED): ChildState.STARTING,
    (ChildState.STARTING, ChildEvent.READY_OK): ChildState.READY,
    (ChildState.STARTING, ChildEvent.READY_LOST): ChildState.STARTING,
    (ChildState.STARTING, ChildEvent.TERM): ChildState.STOPPING,
    (ChildState.STARTING, ChildEvent.EXITED): ChildState.LINGERING,      # gone only once what it started is gone too
    (ChildState.STARTING, ChildEvent.EMPTIED): ChildState.STARTING,      # only a reaped child's emptiness counts
    (ChildState.READY, ChildEvent.STARTED): ChildState.READY,
    (ChildState.READY, ChildEvent.READY_OK): ChildState.READY,
    (ChildState.READY, ChildEvent.READY_LOST): ChildState.NOT_READY,
    (ChildState.READY, ChildEvent.TERM): ChildState.STOPPING,
    (ChildState.READY, ChildEvent.EXITED): ChildState.LINGERING,
    (ChildState.READY, ChildEvent.EMPTIED): ChildState.READY,
    (ChildState.NOT_READY, ChildEvent.STARTED): ChildState.NOT_READY,
    (ChildState.NOT_READY, ChildEvent.READY_OK): ChildState.READY,
    (ChildState.NOT_READY, ChildEvent.READY_LOST): ChildState.NOT_READY,
    (ChildState.NOT_READY, ChildEvent.TERM): ChildState.STOPPING,
    (ChildState.NOT_READY, ChildEvent.EXITED): ChildState.LINGERING,
    (ChildState.NOT_READY, ChildEvent.EMPTIED): ChildState.NOT_READY,
    (ChildState.STOPPING, ChildEvent.STARTED): ChildState.STOPPING,
    (ChildState.STOPPING, ChildEvent.READY_OK): ChildState.STOPPING,     # draining: readiness no longer matters
    (ChildState.STOPPING, ChildEvent.READY_LOST): ChildState.STOPPING,
    (ChildState.STOPPING, ChildEvent.TERM): ChildState.STOPPING,
    (ChildState.STOPPING, ChildEvent.EXITED): ChildState.LINGERING,
    (ChildState.STOPPING, ChildEvent.EMPTIED): ChildState.STOPPING,
    (ChildState.LINGERING, ChildEvent.STARTED): ChildState.LINGERING,
    (ChildState.LINGERING, ChildEvent.READY_OK): ChildState.LINGERING,   # an answer from what it left: not the service
    (ChildState.LINGERING, ChildEvent.READY_LOST): ChildState.LINGERING,
    (ChildState.LINGERING, ChildEvent.TERM): ChildState.LINGERING,
    (ChildState.LINGERING, ChildEvent.EXITED): ChildState.LINGERING,
    (ChildState.LINGERING, ChildEvent.EMPTIED): ChildState.EXITED,
    (ChildState.EXITED, ChildEvent.STARTED): ChildState.EXITED,
    (ChildState.EXITED, ChildEvent.READY_OK): ChildState.EXITED,         # an answer that was on its way when it died
    (ChildState.EXITED, ChildEvent.READY_LOST): ChildState.EXITED,
    (ChildState.EXITED, ChildEvent.TERM): ChildState.EXITED,
    (ChildState.EXITED, ChildEvent.EXITED): ChildState.EXITED,
    (ChildState.EXITED, ChildEvent.EMPTIED): ChildState.EXITED,
}

# a process we started runs
ALIVE_STATES = frozenset({ChildState.STARTING, ChildState.READY, ChildState.NOT_READY, ChildState.STOPPING})
PROBED_STATES = frozenset({ChildState.STARTING, ChildState.READY, ChildState.NOT_READY})  # its probes matter


def next_state(state: ChildState, event: ChildEvent) -> ChildState:
    return CHILD_TABLE[(state, event)]


def is_alive(state: ChildState) -> bool:
    return state in ALIVE_STATES


@dataclass(frozen=True)
class ChildRules:
    """What a child's exit means for the unit when nobody told it to stop, and whether
    it runs contained (what it starts is ended with it before it counts as gone)."""
    kind: str
    contained: bool = True

    def unexpected_exit(self, name: str, code: int) -> tuple[int, str]:
        if self.kind == "mps":
            return EXIT_MPS_DIED, f"the MPS control daemon died (code {code})"
        if code == 0:
            return EXIT_SERVICE_STOPPED, f"{name} exited with code 0 on its own"
        return code, f"{name} exited with code {code}"


SERVICE = ChildRules("service")
MPS = ChildRules("mps", contained=False)  # a detached daemon adopted by the supervisor, not started in a cgroup

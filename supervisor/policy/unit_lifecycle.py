"""The unit's own lifecycle (the supervisor's) as a table, and its exit code: the first
cause is kept. Pure: no I/O, no clock, no asyncio.

The driver (driver/supervisor.py) fires a `UnitEvent` and carries out the `Action`s the
table returns. A pair missing from UNIT_TABLE is a bug: the table is complete and a test
checks it.
"""

from __future__ import annotations

import enum

from supervisor.policy.exit_codes import CLEAN_STOP_CODES, EXIT_DRAIN_INCOMPLETE, EXIT_FORCED, EXIT_OK


class UnitState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


class UnitEvent(str, enum.Enum):
    ALL_READY = "all_ready"
    FAIL = "fail"            # a cause with its own code: a death, a timeout, a setup error
    STOP = "stop"            # SIGTERM, SIGHUP, SIGQUIT, `onecard stop`: drain, exit 0
    INTERRUPT = "interrupt"  # SIGINT: a STOP the first time, skip the wait the second
    GRACE_EXPIRED = "grace_expired"
    ALL_EXITED = "all_exited"


class Action(str, enum.Enum):
    TERMINATE = "terminate"  # SIGTERM every service's group, arm the grace timer
    KILL = "kill"            # SIGKILL every service's group now


_TERMINATE = (Action.TERMINATE,)
_KILL = (Action.KILL,)

# (state, event) -> (the next state, what the driver does)
UNIT_TABLE: dict[tuple[UnitState, UnitEvent], tuple[UnitState, tuple[Action, ...]]] = {
    (UnitState.STARTING, UnitEvent.ALL_READY): (UnitState.RUNNING, ()),
    (UnitState.STARTING, UnitEvent.FAIL): (UnitState.STOPPING, _TERMINATE),
    (UnitState.STARTING, UnitEvent.STOP): (UnitState.STOPPING, _TERMINATE),
    (UnitState.STARTING, UnitEvent.INTERRUPT): (UnitState.STOPPING, _TERMINATE),
    (UnitState.STARTING, UnitEvent.GRACE_EXPIRED): (UnitState.STARTING, ()),  # no grace runs before a stop
    (UnitState.STARTING, UnitEvent.ALL_EXITED): (UnitState.STARTING, ()),     # nothing spawned yet
    (UnitState.RUNNING, UnitEvent.ALL_READY): (UnitState.RUNNING, ()),
    (UnitState.RUNNING, UnitEvent.FAIL): (UnitState.STOPPING, _TERMINATE),
    (UnitState.RUNNING, UnitEvent.STOP): (UnitState.STOPPING, _TERMINATE),
    (UnitState.RUNNING, UnitEvent.INTERRUPT): (UnitState.STOPPING, _TERMINATE),
    (UnitState.RUNNING, UnitEvent.GRACE_EXPIRED): (UnitState.RUNNING, ()),
    (UnitState.RUNNING, UnitEvent.ALL_EXITED): (UnitState.STOPPING, ()),      # cannot happen: a death is a FAIL first
    (UnitState.STOPPING, UnitEvent.ALL_READY): (UnitState.STOPPING, ()),
    (UnitState.STOPPING, UnitEvent.FAIL): (UnitState.STOPPING, ()),           # the first cause's code is kept
    (UnitState.STOPPING, UnitEvent.STOP): (UnitState.STOPPING, ()),           # already draining
    (UnitState.STOPPING, UnitEvent.INTERRUPT): (UnitState.STOPPING, _KILL),
    (UnitState.STOPPING, UnitEvent.GRACE_EXPIRED): (UnitState.STOPPING, _KILL),
    (UnitState.STOPPING, UnitEvent.ALL_EXITED): (UnitState.DONE, ()),
    **{(UnitState.DONE, event): (UnitState.DONE, ()) for event in UnitEvent},
}


class UnitLifecycle:
    """The supervisor's own state and its exit code: the first cause is kept."""

    def __init__(self) -> None:
        self.state = UnitState.STARTING
        self.code: int | None = None
        self.reason = ""
        self.requested = False    # the first cause was a signal or `onecard stop`
        self.forced = False

    @property
    def stopping(self) -> bool:
        return self.state in (UnitState.STOPPING, UnitState.DONE)

    def fire(self, event: UnitEvent, code: int = EXIT_OK, reason: str = "") -> tuple[Action, ...]:
        new, actions = UNIT_TABLE[(self.state, event)]
        if not self.stopping and new == UnitState.STOPPING:
            self.code, self.reason = code, reason
            self.requested = event in (UnitEvent.STOP, UnitEvent.INTERRUPT)
        elif self.state == UnitState.STOPPING and event == UnitEvent.INTERRUPT:
            self.forced = True
            self.reason += "; second SIGINT: killed at once"
            if self.requested:
                self.code = EXIT_FORCED
        self.state = new
        return actions

    def exit_code(self, service_codes: list[int | None], killed_left: int = 0, alive_left: int = 0) -> int:
        """At the end: a requested stop is 0 only when every service stopped cleanly and
        nothing they started had to be SIGKILLed; and never 0 while a process the unit
        started is still alive (`alive_left`)."""
        code = EXIT_OK if self.code is None else self.code
        if alive_left:
            self.reason += f"; {alive_left} process(es) it started are still alive"
        if code != EXIT_OK:
            return code
        if self.requested:
            unclean = [c for c in service_codes if c is not None and c not in CLEAN_STOP_CODES]
            if unclean:
                self.reason += f"; drain incomplete (service exit codes {sorted(set(unclean))})"
                return EXIT_DRAIN_INCOMPLETE
            if killed_left:
                self.reason += (f"; drain incomplete ({killed_left} process(es) the services started "
                                f"were SIGKILLed after grace_s)")
                return EXIT_DRAIN_INCOMPLETE
        return EXIT_DRAIN_INCOMPLETE if alive_left else code

"""Lifecycles as tables: a child's states and events, and the unit's rules. Pure: no I/O,
no clock, no asyncio. The driver (unit.py) turns what the OS layer and the probes report
into these events and carries out the actions the tables return.

Every child (a service, the MPS control daemon) moves through the same CHILD_TABLE; what
its death means for the unit is its `Rules`. The unit itself (the supervisor) moves
through UNIT_TABLE. A pair missing from a table is a bug, not an event to ignore
silently: both tables are complete and a test checks it.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass


class State(str, enum.Enum):
    PENDING = "pending"      # not started yet
    STARTING = "starting"    # started, not ready yet
    READY = "ready"          # answering /readyz 200 (MPS: control socket up)
    NOT_READY = "not_ready"  # was ready, /readyz no longer 200 (still alive)
    STOPPING = "stopping"    # told to stop (SIGTERM, MPS quit), not gone yet
    LINGERING = "lingering"  # its main process was reaped; processes it started still run
    EXITED = "exited"        # reaped, and nothing it started is left


class Event(str, enum.Enum):
    STARTED = "started"        # spawned (MPS: the daemon adopted)
    READY_OK = "ready_ok"      # /readyz 200 from our child
    READY_LOST = "ready_lost"  # /readyz not 200, no answer, or an answer that is not our child's
    TERM = "term"              # we told it to stop
    EXITED = "exited"          # its main process's exit was reaped
    EMPTIED = "emptied"        # no process it started is left (its cgroup or tree is empty)


S, E = State, Event
_ALIVE = (S.STARTING, S.READY, S.NOT_READY)

CHILD_TABLE: dict[tuple[State, Event], State] = {
    (S.PENDING, E.STARTED): S.STARTING,
    (S.PENDING, E.READY_OK): S.PENDING,      # a late probe answer: nothing runs yet
    (S.PENDING, E.READY_LOST): S.PENDING,
    (S.PENDING, E.TERM): S.EXITED,           # never started: nothing to wait for
    (S.PENDING, E.EXITED): S.EXITED,
    (S.PENDING, E.EMPTIED): S.PENDING,
    (S.STARTING, E.STARTED): S.STARTING,
    (S.STARTING, E.READY_OK): S.READY,
    (S.STARTING, E.READY_LOST): S.STARTING,
    (S.STARTING, E.TERM): S.STOPPING,
    (S.STARTING, E.EXITED): S.LINGERING,     # gone only once what it started is gone too
    (S.STARTING, E.EMPTIED): S.STARTING,     # only a reaped child's emptiness counts
    (S.READY, E.STARTED): S.READY,
    (S.READY, E.READY_OK): S.READY,
    (S.READY, E.READY_LOST): S.NOT_READY,
    (S.READY, E.TERM): S.STOPPING,
    (S.READY, E.EXITED): S.LINGERING,
    (S.READY, E.EMPTIED): S.READY,
    (S.NOT_READY, E.STARTED): S.NOT_READY,
    (S.NOT_READY, E.READY_OK): S.READY,
    (S.NOT_READY, E.READY_LOST): S.NOT_READY,
    (S.NOT_READY, E.TERM): S.STOPPING,
    (S.NOT_READY, E.EXITED): S.LINGERING,
    (S.NOT_READY, E.EMPTIED): S.NOT_READY,
    (S.STOPPING, E.STARTED): S.STOPPING,
    (S.STOPPING, E.READY_OK): S.STOPPING,    # draining: readiness no longer matters
    (S.STOPPING, E.READY_LOST): S.STOPPING,
    (S.STOPPING, E.TERM): S.STOPPING,
    (S.STOPPING, E.EXITED): S.LINGERING,
    (S.STOPPING, E.EMPTIED): S.STOPPING,
    (S.LINGERING, E.STARTED): S.LINGERING,
    (S.LINGERING, E.READY_OK): S.LINGERING,  # an answer from what it left: not the service
    (S.LINGERING, E.READY_LOST): S.LINGERING,
    (S.LINGERING, E.TERM): S.LINGERING,
    (S.LINGERING, E.EXITED): S.LINGERING,
    (S.LINGERING, E.EMPTIED): S.EXITED,
    (S.EXITED, E.STARTED): S.EXITED,
    (S.EXITED, E.READY_OK): S.EXITED,        # an answer that was on its way when it died
    (S.EXITED, E.READY_LOST): S.EXITED,
    (S.EXITED, E.TERM): S.EXITED,
    (S.EXITED, E.EXITED): S.EXITED,
    (S.EXITED, E.EMPTIED): S.EXITED,
}


def next_state(state: State, event: Event) -> State:
    return CHILD_TABLE[(state, event)]


def is_alive(state: State) -> bool:
    return state in _ALIVE or state == S.STOPPING


# ---- exit codes -----------------------------------------------------------------------
EXIT_OK = 0
EXIT_CONTROL_FAILED = 1        # control socket or run directory unusable; nothing started
EXIT_CONFIG = 2                # invalid configuration (the CLI); nothing started
EXIT_STARTUP_TIMEOUT = 3
EXIT_LIVENESS = 4
EXIT_MPS_FAILED = 5            # the MPS control daemon would not start; nothing else started
EXIT_MPS_DIED = 6              # the MPS control daemon died while the unit ran
EXIT_SERVICE_STOPPED = 69      # EX_UNAVAILABLE: a service exited 0 on its own
EXIT_DRAIN_INCOMPLETE = 75     # EX_TEMPFAIL: a requested stop lost in-flight work
EXIT_SETUP = 78                # EX_CONFIG: a port is taken (or a service could not start)
EXIT_SPAWN_FAILED = 127
EXIT_FORCED = 130              # a second SIGINT cut a requested stop short

CLEAN_STOP_CODES = frozenset({0, 128 + signal.SIGTERM})  # exited when told to, or by our SIGTERM


@dataclass(frozen=True)
class Rules:
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


SERVICE = Rules("service")
MPS = Rules("mps", contained=False)  # a detached daemon adopted by the supervisor, not started in a cgroup


# ---- the unit (the supervisor itself) ---------------------------------------------------
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


U, UE, A = UnitState, UnitEvent, Action
UNIT_TABLE: dict[tuple[UnitState, UnitEvent], tuple[UnitState, tuple[Action, ...]]] = {
    (U.STARTING, UE.ALL_READY): (U.RUNNING, ()),
    (U.STARTING, UE.FAIL): (U.STOPPING, (A.TERMINATE,)),
    (U.STARTING, UE.STOP): (U.STOPPING, (A.TERMINATE,)),
    (U.STARTING, UE.INTERRUPT): (U.STOPPING, (A.TERMINATE,)),
    (U.STARTING, UE.GRACE_EXPIRED): (U.STARTING, ()),    # no grace runs before a stop
    (U.STARTING, UE.ALL_EXITED): (U.STARTING, ()),       # nothing spawned yet
    (U.RUNNING, UE.ALL_READY): (U.RUNNING, ()),
    (U.RUNNING, UE.FAIL): (U.STOPPING, (A.TERMINATE,)),
    (U.RUNNING, UE.STOP): (U.STOPPING, (A.TERMINATE,)),
    (U.RUNNING, UE.INTERRUPT): (U.STOPPING, (A.TERMINATE,)),
    (U.RUNNING, UE.GRACE_EXPIRED): (U.RUNNING, ()),
    (U.RUNNING, UE.ALL_EXITED): (U.STOPPING, ()),        # cannot happen: a death is a FAIL first
    (U.STOPPING, UE.ALL_READY): (U.STOPPING, ()),
    (U.STOPPING, UE.FAIL): (U.STOPPING, ()),             # the first cause's code is kept
    (U.STOPPING, UE.STOP): (U.STOPPING, ()),             # already draining
    (U.STOPPING, UE.INTERRUPT): (U.STOPPING, (A.KILL,)),
    (U.STOPPING, UE.GRACE_EXPIRED): (U.STOPPING, (A.KILL,)),
    (U.STOPPING, UE.ALL_EXITED): (U.DONE, ()),
    **{(U.DONE, ev): (U.DONE, ()) for ev in UnitEvent},
}

# Signals: what each one a container runtime or a terminal sends means here.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # graceful, like tini/s6/gunicorn's TERM
INTERRUPT_SIGNALS = (signal.SIGINT,)                            # graceful; twice: kill now
IGNORED_SIGNALS = (signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2)  # never stop us
HANDLED_SIGNALS = STOP_SIGNALS + INTERRUPT_SIGNALS + (signal.SIGCHLD,)         # held until handled (early.py)


class Unit:
    """The supervisor's own lifecycle and its exit code: the first cause is kept."""

    def __init__(self) -> None:
        self.state = U.STARTING
        self.code: int | None = None
        self.reason = ""
        self.requested = False    # the first cause was a signal or `onecard stop`
        self.forced = False

    @property
    def stopping(self) -> bool:
        return self.state in (U.STOPPING, U.DONE)

    def fire(self, event: UnitEvent, code: int = EXIT_OK, reason: str = "") -> tuple[Action, ...]:
        new, actions = UNIT_TABLE[(self.state, event)]
        if self.state not in (U.STOPPING, U.DONE) and new == U.STOPPING:
            self.code, self.reason = code, reason
            self.requested = event in (UE.STOP, UE.INTERRUPT)
        elif self.state == U.STOPPING and event == UE.INTERRUPT:
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

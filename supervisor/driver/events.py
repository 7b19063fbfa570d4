"""The driver's own events: what the OS layer, the signal handlers, the timers and the
endpoints tell the driver's loop. Each is a small dataclass; the driver dispatches by type
through a table (driver/supervisor.py), to which every helper adds its own events and
handlers beside their code (service_watch.py, descendants.py, mps_child.py,
endpoints.py). A new event is a dataclass, a handler and a row in its owner's
`handlers()`: the driver's loop does not change.

A handler may return events: the driver applies them at once, before anything queued
(a liveness verdict, say, is the unit's cause before a death reaped a moment later).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from supervisor.driver.child import ChildProcess

Handler = Callable[[Any], Iterable[object] | None]
Handlers = dict[type, Handler]


class TimerEvent:
    """A timer that fired. The exits already due are reaped before it is handled: a
    supervisor that was frozen (SIGSTOP) resumes with both due, and the exits came first."""


@dataclass(frozen=True)
class ChildrenChanged:
    """SIGCHLD: a child of ours (a service, a helper, an adopted orphan) changed state."""


@dataclass(frozen=True)
class SignalReceived:
    sig: int


@dataclass(frozen=True)
class UnitFailed:
    """A cause with its own exit code: a death, a timeout, a setup error."""
    code: int
    reason: str


@dataclass(frozen=True)
class ServicesMayStart:
    """Every port is free and the MPS daemon (when on) runs: start the services."""


@dataclass(frozen=True)
class ChildExited:
    """A supervised child's main process was reaped with this code (128+N: signal N)."""
    child: ChildProcess
    code: int


@dataclass(frozen=True)
class StopRequested:
    """`onecard stop` over the control socket."""


@dataclass(frozen=True)
class GraceExpired(TimerEvent):
    """grace_s after the first SIGTERM: what is left gets SIGKILL."""

"""The driver's wiring: every event has exactly one handler in its dispatch table, and
its helpers reach it only through the port (supervisor/driver/port.py), never holding
the driver itself."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from supervisor.driver import descendants, endpoints, events, mps_child, service_watch
from supervisor.driver.port import DriverPort
from supervisor.driver.supervisor import Supervisor, _dispatch_table
from tests.fakes.scripted_supervisor import make

EVENT_MODULES = (events, service_watch, descendants, endpoints, mps_child)


def _event_types() -> set[type]:
    return {cls for module in EVENT_MODULES for _, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == module.__name__ and dataclasses.is_dataclass(cls)}


def test_every_event_has_one_handler(tmp_path):
    s, *_ = make(tmp_path, gpu={"mps": True})
    assert s.mps is not None
    assert set(s._handlers) == _event_types()


def test_two_handlers_for_one_event_are_refused():
    with pytest.raises(ValueError, match="two handlers for StopRequested"):
        _dispatch_table({events.StopRequested: print}, {events.StopRequested: print})


def test_the_helpers_hold_the_port_not_the_driver(tmp_path):
    s, *_ = make(tmp_path, gpu={"mps": True})
    for helper in (s.watch, s.descendants, s.output, s.endpoints, s.mps):
        held = list(vars(helper).values())
        assert any(isinstance(v, DriverPort) for v in held), type(helper).__name__
        assert not any(isinstance(v, Supervisor) for v in held), type(helper).__name__

"""The supervisor's own lifecycle rules, state by state: which child states are alive,
what an unexpected exit means, how the unit keeps its first cause, what a second SIGINT
changes, and when a requested stop is an incomplete drain. test_policy.py replays whole
histories through the driver; these pin each rule of the tables' helpers."""

from __future__ import annotations

import pytest

from supervisor.lifecycle import (EXIT_DRAIN_INCOMPLETE, EXIT_FORCED, EXIT_MPS_DIED, EXIT_SERVICE_STOPPED, MPS,
                                  SERVICE, Action, State, Unit, UnitEvent, UnitState, is_alive)


@pytest.mark.parametrize("state,alive", [(State.PENDING, False), (State.STARTING, True), (State.READY, True),
                                         (State.NOT_READY, True), (State.STOPPING, True), (State.EXITED, False)])
def test_a_child_is_alive_from_its_start_until_it_is_reaped(state, alive):
    assert is_alive(state) is alive


def test_what_an_unexpected_exit_means():
    assert MPS.unexpected_exit("mps", 0) == (EXIT_MPS_DIED, "the MPS control daemon died (code 0)")
    assert MPS.unexpected_exit("mps", 9) == (EXIT_MPS_DIED, "the MPS control daemon died (code 9)")
    assert SERVICE.unexpected_exit("detect", 0) == (EXIT_SERVICE_STOPPED, "detect exited with code 0 on its own")
    assert SERVICE.unexpected_exit("detect", 3) == (3, "detect exited with code 3")


def test_a_new_unit_is_starting_with_no_cause():
    u = Unit()
    assert (u.state, u.code, u.reason, u.requested, u.forced, u.stopping) == (UnitState.STARTING, None, "", False,
                                                                            False, False)
    assert u.exit_code([]) == 0


def test_readiness_keeps_no_cause_and_a_later_failure_is_the_cause():
    u = Unit()
    assert u.fire(UnitEvent.ALL_READY) == ()
    assert (u.state, u.code, u.reason, u.stopping) == (UnitState.RUNNING, None, "", False)
    assert u.fire(UnitEvent.FAIL, 7, "b crashed") == (Action.TERMINATE,)
    assert (u.state, u.code, u.reason, u.requested, u.stopping) == (UnitState.STOPPING, 7, "b crashed", False, True)
    u.fire(UnitEvent.ALL_EXITED)
    assert u.state == UnitState.DONE and u.stopping
    assert u.exit_code([7, 137]) == 7 and u.reason == "b crashed"  # a failure is not a drain


@pytest.mark.parametrize("event", [UnitEvent.STOP, UnitEvent.INTERRUPT])
def test_a_stop_or_a_first_sigint_is_a_requested_stop(event):
    u = Unit()
    u.fire(UnitEvent.ALL_READY)
    assert u.fire(event, 0, "SIGTERM received") == (Action.TERMINATE,)
    assert (u.code, u.reason, u.requested, u.forced) == (0, "SIGTERM received", True, False)


def test_a_second_sigint_after_a_requested_stop_kills_and_exits_130():
    u = Unit()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.fire(UnitEvent.INTERRUPT) == (Action.KILL,)
    assert (u.forced, u.code) == (True, EXIT_FORCED)
    assert u.reason == "SIGTERM received; second SIGINT: killed at once"
    u.fire(UnitEvent.ALL_EXITED)
    assert u.exit_code([137]) == EXIT_FORCED


def test_a_second_sigint_after_a_failure_kills_but_keeps_the_failures_code():
    u = Unit()
    u.fire(UnitEvent.FAIL, 4, "liveness")
    u.fire(UnitEvent.INTERRUPT)
    assert (u.forced, u.code, u.reason) == (True, 4, "liveness; second SIGINT: killed at once")


def test_events_after_the_end_change_nothing():
    u = Unit()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    u.fire(UnitEvent.ALL_EXITED)
    for event in UnitEvent:
        assert u.fire(event, 9, "late") == ()
    assert (u.state, u.code, u.reason, u.forced) == (UnitState.DONE, 0, "SIGTERM received", False)


def test_a_requested_stop_is_incomplete_when_a_service_did_not_stop_cleanly():
    u = Unit()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.exit_code([0, 143, None]) == 0 and u.reason == "SIGTERM received"  # None: never started
    assert u.exit_code([137, 0, 1, 137]) == EXIT_DRAIN_INCOMPLETE
    assert u.reason == "SIGTERM received; drain incomplete (service exit codes [1, 137])"


def test_a_cause_given_without_a_reason_has_none():
    u = Unit()
    u.fire(UnitEvent.INTERRUPT)
    assert (u.reason, u.requested) == ("", True)
    u.fire(UnitEvent.INTERRUPT)
    assert u.reason == "; second SIGINT: killed at once"

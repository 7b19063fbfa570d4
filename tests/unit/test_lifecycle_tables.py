"""The policy's lifecycle tables and the unit's exit code, rule by rule (supervisor/policy/):
the tables are complete, which child states are alive, what an unexpected exit means, how
the unit keeps its first cause, what a second SIGINT changes, and when a requested stop
is an incomplete drain. Whole histories through the driver: test_driver_*.py."""

from __future__ import annotations

import itertools

import pytest

from supervisor.policy.child_lifecycle import CHILD_TABLE, MPS, SERVICE, ChildEvent, ChildState, is_alive, next_state
from supervisor.policy.exit_codes import EXIT_DRAIN_INCOMPLETE, EXIT_FORCED, EXIT_MPS_DIED, EXIT_SERVICE_STOPPED
from supervisor.policy.unit_lifecycle import UNIT_TABLE, Action, UnitEvent, UnitLifecycle, UnitState


def test_child_table_is_complete():
    assert set(CHILD_TABLE) == set(itertools.product(ChildState, ChildEvent))


def test_unit_table_is_complete():
    assert set(UNIT_TABLE) == set(itertools.product(UnitState, UnitEvent))


@pytest.mark.parametrize("path,end", [
    ([ChildEvent.STARTED, ChildEvent.READY_OK], ChildState.READY),
    ([ChildEvent.STARTED, ChildEvent.READY_OK, ChildEvent.READY_LOST], ChildState.NOT_READY),
    ([ChildEvent.STARTED, ChildEvent.READY_OK, ChildEvent.READY_LOST, ChildEvent.READY_OK], ChildState.READY),
    ([ChildEvent.STARTED, ChildEvent.READY_LOST], ChildState.STARTING),
    ([ChildEvent.STARTED, ChildEvent.READY_OK, ChildEvent.TERM, ChildEvent.READY_OK], ChildState.STOPPING),
    ([ChildEvent.STARTED, ChildEvent.TERM, ChildEvent.EXITED, ChildEvent.READY_OK], ChildState.LINGERING),
    ([ChildEvent.STARTED, ChildEvent.TERM, ChildEvent.EXITED, ChildEvent.EMPTIED, ChildEvent.READY_OK],
     ChildState.EXITED),
    # only a reaped child can be empty
    ([ChildEvent.STARTED, ChildEvent.READY_OK, ChildEvent.EMPTIED], ChildState.READY),
    ([ChildEvent.TERM], ChildState.EXITED),
])
def test_child_paths(path, end):
    state = ChildState.PENDING
    for event in path:
        state = next_state(state, event)
    assert state == end


def test_first_cause_is_kept_and_second_sigint_only_forces():
    u = UnitLifecycle()
    assert u.fire(UnitEvent.FAIL, 7, "b crashed") == (Action.TERMINATE,)
    assert u.fire(UnitEvent.INTERRUPT) == (Action.KILL,)
    assert u.fire(UnitEvent.STOP, 0, "SIGTERM") == ()
    u.fire(UnitEvent.ALL_EXITED)
    assert u.state == UnitState.DONE and u.exit_code([7, 137]) == 7


def test_requested_stop_is_0_only_when_every_service_stops_cleanly():
    u = UnitLifecycle()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.exit_code([0, 143]) == 0
    assert u.exit_code([0, 137]) == 75  # one was SIGKILLed: work was lost
    assert u.exit_code([75, 0]) == 75   # one's own drain ran out
    u2 = UnitLifecycle()
    u2.fire(UnitEvent.INTERRUPT, 0, "SIGINT received")
    u2.fire(UnitEvent.INTERRUPT)
    assert u2.exit_code([137]) == 130


@pytest.mark.parametrize("state,alive", [
    (ChildState.PENDING, False), (ChildState.STARTING, True), (ChildState.READY, True),
    (ChildState.NOT_READY, True), (ChildState.STOPPING, True), (ChildState.EXITED, False)])
def test_a_child_is_alive_from_its_start_until_it_is_reaped(state, alive):
    assert is_alive(state) is alive


def test_what_an_unexpected_exit_means():
    assert MPS.unexpected_exit("mps", 0) == (EXIT_MPS_DIED, "the MPS control daemon died (code 0)")
    assert MPS.unexpected_exit("mps", 9) == (EXIT_MPS_DIED, "the MPS control daemon died (code 9)")
    assert SERVICE.unexpected_exit("detect", 0) == (EXIT_SERVICE_STOPPED, "detect exited with code 0 on its own")
    assert SERVICE.unexpected_exit("detect", 3) == (3, "detect exited with code 3")


def test_a_new_unit_is_starting_with_no_cause():
    u = UnitLifecycle()
    assert (u.state, u.code, u.reason, u.requested, u.forced, u.stopping) == (UnitState.STARTING, None, "", False,
                                                                            False, False)
    assert u.exit_code([]) == 0


def test_readiness_keeps_no_cause_and_a_later_failure_is_the_cause():
    u = UnitLifecycle()
    assert u.fire(UnitEvent.ALL_READY) == ()
    assert (u.state, u.code, u.reason, u.stopping) == (UnitState.RUNNING, None, "", False)
    assert u.fire(UnitEvent.FAIL, 7, "b crashed") == (Action.TERMINATE,)
    assert (u.state, u.code, u.reason, u.requested, u.stopping) == (UnitState.STOPPING, 7, "b crashed", False, True)
    u.fire(UnitEvent.ALL_EXITED)
    assert u.state == UnitState.DONE and u.stopping
    assert u.exit_code([7, 137]) == 7 and u.reason == "b crashed"  # a failure is not a drain


@pytest.mark.parametrize("event", [UnitEvent.STOP, UnitEvent.INTERRUPT])
def test_a_stop_or_a_first_sigint_is_a_requested_stop(event):
    u = UnitLifecycle()
    u.fire(UnitEvent.ALL_READY)
    assert u.fire(event, 0, "SIGTERM received") == (Action.TERMINATE,)
    assert (u.code, u.reason, u.requested, u.forced) == (0, "SIGTERM received", True, False)


def test_a_second_sigint_after_a_requested_stop_kills_and_exits_130():
    u = UnitLifecycle()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.fire(UnitEvent.INTERRUPT) == (Action.KILL,)
    assert (u.forced, u.code) == (True, EXIT_FORCED)
    assert u.reason == "SIGTERM received; second SIGINT: killed at once"
    u.fire(UnitEvent.ALL_EXITED)
    assert u.exit_code([137]) == EXIT_FORCED


def test_a_second_sigint_after_a_failure_kills_but_keeps_the_failures_code():
    u = UnitLifecycle()
    u.fire(UnitEvent.FAIL, 4, "liveness")
    u.fire(UnitEvent.INTERRUPT)
    assert (u.forced, u.code, u.reason) == (True, 4, "liveness; second SIGINT: killed at once")


def test_events_after_the_end_change_nothing():
    u = UnitLifecycle()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    u.fire(UnitEvent.ALL_EXITED)
    for event in UnitEvent:
        assert u.fire(event, 9, "late") == ()
    assert (u.state, u.code, u.reason, u.forced) == (UnitState.DONE, 0, "SIGTERM received", False)


def test_a_requested_stop_is_incomplete_when_a_service_did_not_stop_cleanly():
    u = UnitLifecycle()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.exit_code([0, 143, None]) == 0 and u.reason == "SIGTERM received"  # None: never started
    assert u.exit_code([137, 0, 1, 137]) == EXIT_DRAIN_INCOMPLETE
    assert u.reason == "SIGTERM received; drain incomplete (service exit codes [1, 137])"


def test_a_cause_given_without_a_reason_has_none():
    u = UnitLifecycle()
    u.fire(UnitEvent.INTERRUPT)
    assert (u.reason, u.requested) == ("", True)
    u.fire(UnitEvent.INTERRUPT)
    assert u.reason == "; second SIGINT: killed at once"


def test_processes_killed_or_alive_at_the_end_decide_the_code_of_a_requested_stop():
    u = UnitLifecycle()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.exit_code([0, 143]) == 0
    assert u.exit_code([0, 0], killed_left=2) == EXIT_DRAIN_INCOMPLETE
    assert u.exit_code([0, 0], alive_left=1) == EXIT_DRAIN_INCOMPLETE
    failed = UnitLifecycle()
    failed.fire(UnitEvent.FAIL, 7, "b exited with code 7")
    assert failed.exit_code([7], killed_left=3, alive_left=1) == 7  # the first cause's code is kept
    assert "still alive" in failed.reason

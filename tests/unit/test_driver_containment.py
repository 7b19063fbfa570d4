"""What the services start, as scripted histories through the driver (tests/fakes/): a
service is gone only once its containment is empty, what ignores SIGTERM is killed at
grace, the last sweep, an earlier run's leftovers, the run's marker. Their real twins:
tests/integration/test_containment.py."""

from __future__ import annotations

import signal

from supervisor.driver import descendants
from supervisor.policy.child_lifecycle import ChildEvent, ChildState
from supervisor.policy.exit_codes import EXIT_DRAIN_INCOMPLETE
from supervisor.system.containment import Leftover
from tests.fakes.scripted_supervisor import history, make, text


def test_a_service_is_gone_only_once_what_it_started_is_gone(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    fake.descendants["a"] = {5001}   # a server that left a's session; it ends on SIGTERM
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)]) == 0
    assert ("a", signal.SIGTERM) in fake.member_signals
    assert s.children[0].history[-2:] == [(ChildState.STOPPING, ChildEvent.EXITED, ChildState.LINGERING),
                                          (ChildState.LINGERING, ChildEvent.EMPTIED, ChildState.EXITED)]


def test_what_a_service_started_and_ignores_sigterm_is_killed_at_grace_and_the_stop_is_75(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    fake.descendants["a"] = {5001}
    fake.stubborn_descendants = {5001}
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)]) == EXIT_DRAIN_INCOMPLETE
    assert ("a", signal.SIGKILL) in fake.member_signals
    assert "a: its main process exited; 1 process(es) it started are still running (pids 5001)" in text(out)
    assert "a: 1 process(es) it started still running after SIGTERM (pids 5001); SIGKILL" in text(out)
    assert "were SIGKILLed after grace_s" in text(out)
    assert s.children[0].killed


def test_a_crash_that_leaves_processes_keeps_its_code_and_ends_them(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    fake.descendants["b"] = {5002}
    fake.stubborn_descendants = {5002}
    assert history(s, clock, [1.0, lambda: fake.die("b", 7 << 8)]) == 7
    assert not fake.descendants["b"]


def test_the_unit_never_exits_0_while_a_process_it_started_is_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(descendants, "SWEEP_TERM_S", 0.05)
    monkeypatch.setattr(descendants, "SWEEP_WAIT_S", 0.1)
    s, fake, clock, _, out = make(tmp_path)
    fake.orphans_alive = {6001}   # adopted by the subreaper, beyond every service's containment
    fake.unkillable = {6001}
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)]) == EXIT_DRAIN_INCOMPLETE
    assert "1 process(es) the unit started are still alive after SIGKILL: pids 6001" in text(out)
    assert not fake.containment_obj.released  # kept: the sentinel goes on trying once we are gone


def test_an_adopted_orphan_is_ended_by_the_last_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(descendants, "SWEEP_TERM_S", 0.05)
    s, fake, clock, _, out = make(tmp_path)
    fake.orphans_alive = {6001}
    assert history(s, clock, [1.0, lambda: fake.die("a", 3 << 8)]) == 3
    assert not fake.orphans_alive and fake.containment_obj.released
    assert "1 process(es) of the unit still running after its services exited (pids 6001)" in text(out)


def test_what_an_earlier_run_left_is_ended_before_the_ports_are_checked(tmp_path):
    checked = []

    def port_check(host, port):
        checked.append(list(fake.ended))
        return None

    s, fake, clock, _, out = make(tmp_path, port_problem=port_check)
    fake.left_behind = [Leftover(4242, "python server.py 9000", "cgroup /sys/fs/cgroup/onecard.x/old")]
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)]) == 0
    assert fake.ended == [4242] and checked[0] == [4242]
    assert ("an earlier run of this unit (its supervisor gone) left 1 process(es): pid 4242 "
            "(python server.py 9000; cgroup /sys/fs/cgroup/onecard.x/old); ending them (SIGKILL)") in text(out)


def test_every_service_joins_its_containment_and_carries_the_run_marker(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)])
    assert fake.joins == {"a": "/fake/a/cgroup.procs", "b": "/fake/b/cgroup.procs"}
    marker = s.descendants.marker
    for env in fake.envs.values():
        assert env["ONECARD_UNIT_ID"] == marker.unit and env["ONECARD_RUN_ID"] == marker.run
    assert "containment: fake containment" in text(out)

"""The rules about what services start, signals held, and a frozen start-up, as scripted
histories (tests/unit/scripted_supervisor.py). Their real twins: tests/integration/
test_containment.py and test_signals.py."""

from __future__ import annotations

import signal

from supervisor import descendants
from supervisor.containment import Leftover
from supervisor.lifecycle import EXIT_DRAIN_INCOMPLETE, Event, State, Unit, UnitEvent
from supervisor.probe import ProbeResult
from tests.unit.scripted_supervisor import history, make, text


def test_a_service_is_gone_only_once_what_it_started_is_gone(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    fake.descendants["a"] = {5001}   # a server that left a's session; it ends on SIGTERM
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)]) == 0
    assert ("a", signal.SIGTERM) in fake.member_signals
    assert s.children[0].history[-2:] == [(State.STOPPING, Event.EXITED, State.LINGERING),
                                          (State.LINGERING, Event.EMPTIED, State.EXITED)]


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


def test_the_stop_signals_are_released_once_handled_and_held_until_exit(tmp_path):
    s, fake, clock, _, _ = make(tmp_path)
    history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)])
    assert fake.held == ["release", "hold"]


def test_a_startup_deadline_probes_again_before_judging(tmp_path):
    """The probe in flight when the deadline passed answers late (a frozen supervisor): a
    fresh one decides."""
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=3)

    def readyz(n):
        if n == 1:
            return _late(clock, 5.0)
        return 200

    script.set("a", "/readyz", readyz)
    code = history(s, clock, [4.0, lambda: s.handle_signal(signal.SIGTERM)])
    assert code == 0 and "not ready after" not in text(out)
    assert s.all_ready_at is not None


def test_a_startup_deadline_still_fails_a_service_that_is_not_ready(tmp_path):
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=1)
    script.set("a", "/readyz", 503)
    assert history(s, clock, [2.0]) == 3
    assert script.calls[("a", "/readyz")] >= 2


def test_a_liveness_round_that_outlasted_its_timeout_is_probed_again_not_counted(tmp_path):
    """A frozen supervisor's in-flight probes time out when it resumes: not a miss."""
    s, fake, clock, script, out = make(tmp_path, liveness_failures=1, liveness_timeout_s=1.0)

    def healthz(n):
        return _late(clock, 5.0) if n == 2 else 200

    script.set("a", "/healthz", healthz)
    code = history(s, clock, [0.5, 1.0, 6.0, 1.0, lambda: s.handle_signal(signal.SIGTERM)])
    assert code == 0, text(out)
    assert "a: a probe round took 5.0 s, past its 1 s timeout" in text(out)
    assert script.calls[("a", "/healthz")] >= 3


def test_a_liveness_miss_within_its_timeout_still_counts(tmp_path):
    s, fake, clock, script, out = make(tmp_path, liveness_failures=1, liveness_timeout_s=1.0)
    script.set("a", "/healthz", lambda n: ProbeResult(None, error="no answer within 1 s") if n >= 2 else 200)
    assert history(s, clock, [0.5, 1.0, 1.0, 1.0]) == 4


async def _late(clock, delay):
    await clock.sleep(delay)
    return ProbeResult(None, error=f"no answer within {delay:g} s")


def test_processes_killed_or_alive_at_the_end_decide_the_code_of_a_requested_stop():
    u = Unit()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.exit_code([0, 143]) == 0
    assert u.exit_code([0, 0], killed_left=2) == EXIT_DRAIN_INCOMPLETE
    assert u.exit_code([0, 0], alive_left=1) == EXIT_DRAIN_INCOMPLETE
    failed = Unit()
    failed.fire(UnitEvent.FAIL, 7, "b exited with code 7")
    assert failed.exit_code([7], killed_left=3, alive_left=1) == 7  # the first cause's code is kept
    assert "still alive" in failed.reason

"""How the unit stops, as scripted histories through the driver (tests/fakes/): a death,
each stop signal, the grace period, a second SIGINT, `onecard stop`, a spawn failure, a
taken port, orphans, and the signal mask around it all. Their real twins:
tests/integration/test_lifecycle.py, test_signals.py, test_control.py."""

from __future__ import annotations

import signal

import pytest

from supervisor.driver.events import StopRequested
from supervisor.policy.child_lifecycle import ChildState
from tests.fakes.scripted_supervisor import history, make, text


def test_child_exit_terminates_the_others_and_returns_its_code(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    assert history(s, clock, [1.0, lambda: fake.die("a", 5 << 8)]) == 5
    assert ("b", signal.SIGTERM) in fake.signals
    assert "a: exited with code 5; stopping every service" in text(out)
    assert "a        | hello from a" in text(out)


def test_signal_death_is_128_plus_n(tmp_path):
    s, fake, clock, _, _ = make(tmp_path)
    assert history(s, clock, [1.0, lambda: fake.die("b", signal.SIGSEGV)]) == 128 + signal.SIGSEGV


def test_a_service_exiting_0_on_its_own_is_a_failure(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    assert history(s, clock, [1.0, lambda: fake.die("a", 0)]) == 69
    assert "exit 69: a exited with code 0 on its own" in text(out)


def test_orphan_is_reaped_not_mistaken_for_a_child(tmp_path):
    s, fake, clock, _, _ = make(tmp_path)

    def orphan():
        fake.exits.append((4242, 0))  # not one of ours
        s.handle_sigchld()

    assert history(s, clock, [1.0, orphan, 1.0, lambda: s.handle_signal(signal.SIGTERM)]) == 0
    assert s.reaper.orphans_reaped == 1 and all(c.state == ChildState.EXITED for c in s.children)
    assert s.unit.reason.startswith("SIGTERM received")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_every_stop_signal_drains_everyone_and_exits_0(tmp_path, sig):
    s, fake, clock, _, _ = make(tmp_path)
    assert history(s, clock, [1.0, lambda: s.handle_signal(sig)]) == 0
    assert {n for n, g in fake.signals if g == signal.SIGTERM} == {"a", "b"}
    assert not [n for n, g in fake.delivered if g == signal.SIGKILL]


def test_a_second_stop_signal_changes_nothing(tmp_path):
    s, fake, clock, _, _ = make(tmp_path, stubborn={"a"})
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM), 0.5,
                              lambda: s.handle_signal(signal.SIGHUP), 0.5]) == 75
    # one SIGTERM (and the SIGCONT that wakes a stopped process to act on it), then killed at grace
    assert [g for n, g in fake.delivered if n == "a"] == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]


def test_stubborn_child_gets_sigkill_after_grace_and_the_drain_is_incomplete(tmp_path):
    s, fake, clock, _, out = make(tmp_path, stubborn={"b"})
    assert history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)]) == 75
    assert ("b", signal.SIGKILL) in fake.delivered
    assert "b: still running 2 s after SIGTERM; SIGKILL" in text(out)
    assert "drain incomplete (service exit codes [137])" in text(out)
    assert s.children[1].killed


def test_second_sigint_kills_at_once_with_130(tmp_path):
    s, fake, clock, _, _ = make(tmp_path, stubborn={"a", "b"}, grace_s=60)
    code = history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGINT), 0.5, lambda: s.handle_signal(signal.SIGINT)])
    assert code == 130
    assert clock.t < 60  # not after the grace period


def test_ctrl_c_while_stopping_for_a_crash_keeps_the_crash_code(tmp_path):
    s, fake, clock, _, _ = make(tmp_path, stubborn={"b"}, grace_s=60)
    code = history(s, clock, [1.0, lambda: fake.die("a", 9 << 8), 0.5, lambda: s.handle_signal(signal.SIGINT)])
    assert code == 9
    assert ("b", signal.SIGKILL) in fake.delivered and clock.t < 60


def test_a_crash_during_a_drain_is_an_incomplete_drain(tmp_path):
    s, fake, clock, _, _ = make(tmp_path, stubborn={"a", "b"})
    code = history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM), 0.5, lambda: fake.die("a", 3 << 8)])
    assert code == 75 and s.unit.reason.startswith("SIGTERM received")


def test_spawn_failure_is_127_and_stops_what_started(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    fake.fail_spawn.add("b")
    assert history(s, clock, [1.0]) == 127
    assert ("a", signal.SIGTERM) in fake.signals
    assert "b: cannot start" in text(out)


def test_a_taken_port_is_78_and_nothing_starts(tmp_path):
    def taken(host, port):
        return f"port {port} on {host} is taken by pid 77 (python3 -m http.server)" if port == 9001 else None

    s, fake, clock, _, out = make(tmp_path, port_problem=taken)
    assert history(s, clock, [1.0]) == 78
    assert fake.spawned == []
    assert "services.b.port: port 9001 on 127.0.0.1 is taken by pid 77" in text(out)


def test_stop_request_drains_like_sigterm(tmp_path):
    s, fake, clock, _, out = make(tmp_path)
    assert history(s, clock, [1.0, lambda: s.port.post(StopRequested())]) == 0
    assert "`onecard stop` requested: draining every service" in text(out)


def test_the_stop_signals_are_released_once_handled_and_held_until_exit(tmp_path):
    s, fake, clock, _, _ = make(tmp_path)
    history(s, clock, [1.0, lambda: s.handle_signal(signal.SIGTERM)])
    assert fake.held == ["release", "hold"]

"""The supervisor's rules replayed as scripted histories: a scripted OS (process table,
signals, reaping), a manual clock and scripted probe answers; no real process here
(tests/unit/scripted_supervisor.py).

Each faked behaviour has its integration twin against real processes:
tests/integration/test_lifecycle.py (exits, signals, grace, orphans, drain),
test_control.py (status, stop, not_ready), test_gpu_resources.py (MPS).
"""

from __future__ import annotations

import asyncio
import itertools
import signal

import pytest

from supervisor.lifecycle import (CHILD_TABLE, UNIT_TABLE, Action, Event, State, Unit, UnitEvent, UnitState,
                                  next_state)
from supervisor.probe import ProbeResult
from tests.unit.scripted_supervisor import history, make, text


# ---- the tables --------------------------------------------------------------------------
def test_child_table_is_complete():
    assert set(CHILD_TABLE) == set(itertools.product(State, Event))


def test_unit_table_is_complete():
    assert set(UNIT_TABLE) == set(itertools.product(UnitState, UnitEvent))


@pytest.mark.parametrize("path,end", [
    ([Event.STARTED, Event.READY_OK], State.READY),
    ([Event.STARTED, Event.READY_OK, Event.READY_LOST], State.NOT_READY),
    ([Event.STARTED, Event.READY_OK, Event.READY_LOST, Event.READY_OK], State.READY),
    ([Event.STARTED, Event.READY_LOST], State.STARTING),
    ([Event.STARTED, Event.READY_OK, Event.TERM, Event.READY_OK], State.STOPPING),
    ([Event.STARTED, Event.TERM, Event.EXITED, Event.READY_OK], State.LINGERING),
    ([Event.STARTED, Event.TERM, Event.EXITED, Event.EMPTIED, Event.READY_OK], State.EXITED),
    ([Event.STARTED, Event.READY_OK, Event.EMPTIED], State.READY),  # only a reaped child can be empty
    ([Event.TERM], State.EXITED),
])
def test_child_paths(path, end):
    state = State.PENDING
    for event in path:
        state = next_state(state, event)
    assert state == end


def test_first_cause_is_kept_and_second_sigint_only_forces():
    u = Unit()
    assert u.fire(UnitEvent.FAIL, 7, "b crashed") == (Action.TERMINATE,)
    assert u.fire(UnitEvent.INTERRUPT) == (Action.KILL,)
    assert u.fire(UnitEvent.STOP, 0, "SIGTERM") == ()
    u.fire(UnitEvent.ALL_EXITED)
    assert u.state == UnitState.DONE and u.exit_code([7, 137]) == 7


def test_requested_stop_is_0_only_when_every_service_stops_cleanly():
    u = Unit()
    u.fire(UnitEvent.STOP, 0, "SIGTERM received")
    assert u.exit_code([0, 143]) == 0
    assert u.exit_code([0, 137]) == 75  # one was SIGKILLed: work was lost
    assert u.exit_code([75, 0]) == 75   # one's own drain ran out
    u2 = Unit()
    u2.fire(UnitEvent.INTERRUPT, 0, "SIGINT received")
    u2.fire(UnitEvent.INTERRUPT)
    assert u2.exit_code([137]) == 130


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
    assert s.orphans_reaped == 1 and all(c.state == State.EXITED for c in s.children)
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
    assert [g for n, g in fake.delivered if n == "a"] == [signal.SIGTERM, signal.SIGKILL]  # killed at grace


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


def test_liveness_failures_in_a_row_stop_the_unit(tmp_path):
    s, fake, clock, script, out = make(tmp_path, liveness_failures=3)
    script.set("b", "/healthz", ProbeResult(None, error="no answer within 1 s"))
    assert history(s, clock, [0.5, 1.0, 1.0, 1.0, 1.0]) == 4
    assert "b: liveness miss 3/3" in text(out)
    assert s.unit.reason.startswith("b failed 3 liveness probes in a row")


def test_a_ready_service_whose_readyz_fails_is_not_ready_then_ready_again(tmp_path):
    s, fake, clock, script, out = make(tmp_path)
    seen = []

    def look():
        seen.append((s.children[0].state, s.view().unit.state))

    def readyz(code):
        return lambda: script.set("a", "/readyz", code)

    code = history(s, clock, [0.5, look, readyz(503), 1.0, look, readyz(200), 1.0, look,
                              lambda: s.handle_signal(signal.SIGTERM)])
    assert code == 0
    assert [st for st, _ in seen] == [State.READY, State.NOT_READY, State.READY]
    assert "a: not ready: /readyz answered 503" in text(out) and "a: ready again" in text(out)


def test_an_answer_from_another_process_is_not_readiness(tmp_path):
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=3)
    script.set("a", "/readyz", "foreign")
    assert history(s, clock, [1.0, 1.0, 1.0, 1.0]) == 3
    assert s.children[0].history == [(State.PENDING, Event.STARTED, State.STARTING),
                                     (State.STARTING, Event.TERM, State.STOPPING),
                                     (State.STOPPING, Event.EXITED, State.LINGERING),
                                     (State.LINGERING, Event.EMPTIED, State.EXITED)]  # never READY
    assert "a not ready after 3 s (last probe: /readyz on 127.0.0.1:9000 was answered by another process" in text(out)


def test_startup_timeout(tmp_path):
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=0.5)
    script.set("a", "/readyz", 503)
    assert history(s, clock, [1.0]) == 3
    assert "a not ready after 0.5 s (last probe: /readyz answered 503)" in text(out)


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
    assert history(s, clock, [1.0, lambda: s.put("stop_request")]) == 0
    assert "`onecard stop` requested: draining every service" in text(out)


# ---- identity of probe answers (probe.py), with a scripted process table ------------------
def _identity_case(result, *, tree=frozenset({50, 51}), listeners=frozenset(), token="t0k3n"):
    from supervisor.child import ChildProcess
    from supervisor.plan import ServicePlan
    from supervisor.probe import ChildProber

    async def prober(target, path, timeout, max_body):
        return result

    child = ChildProcess(ServicePlan("svc", "127.0.0.1", 9000, ["x"], {}, {}, 1), pid=50, token=token)
    p = ChildProber(prober, tree_pids=lambda pid: set(tree), listener_pids=lambda port, pids: set(listeners) & pids)
    return asyncio.run(p.get(child, "/readyz", 1.0)), child


@pytest.mark.parametrize("result,ours", [
    (ProbeResult(200, b"{}", instance="t0k3n", via="tcp"), True),
    (ProbeResult(200, b'{"instance": "t0k3n"}', via="tcp"), True),
    (ProbeResult(200, b'{"pid": 51}', instance="stale-token", via="tcp"), False),  # the token decides
    (ProbeResult(200, b'{"instance": "other", "pid": 50}', via="tcp"), False),
    (ProbeResult(200, b'{"pid": 51}', via="tcp"), True),      # a pid of the child's tree
    (ProbeResult(200, b'{"pid": 99}', via="tcp"), False),
    (ProbeResult(200, b'{"ready": true}', via="tcp"), False),  # no identity, port held by someone else
    (ProbeResult(200, b'{"ready": true}', via="unix"), True),  # our private socket directory
])
def test_only_our_childs_answers_count(result, ours):
    got, _ = _identity_case(result)
    assert got.ok is ours and got.foreign is (not ours)


def test_a_listener_in_the_tree_makes_an_anonymous_answer_ours():
    got, child = _identity_case(ProbeResult(200, b"{}", via="tcp"), listeners={51})
    assert got.ok


def test_every_anonymous_answer_is_checked_not_only_the_first():
    """The server dies and another process takes the port: the next answer is foreign."""
    from supervisor.child import ChildProcess
    from supervisor.plan import ServicePlan
    from supervisor.probe import ChildProber

    listeners = {51}

    async def prober(target, path, timeout, max_body):
        return ProbeResult(200, b"{}", via="tcp")

    child = ChildProcess(ServicePlan("svc", "127.0.0.1", 9000, ["x"], {}, {}, 1), pid=50, token="t")
    p = ChildProber(prober, tree_pids=lambda pid: {50, 51}, listener_pids=lambda port, pids: listeners & pids)

    async def twice():
        first = await p.get(child, "/healthz", 1.0)
        listeners.clear()   # our server (51) is gone; someone outside the tree listens now
        return first, await p.get(child, "/healthz", 1.0)

    first, second = asyncio.run(twice())
    assert first.ok and not second.ok and second.foreign
    assert "no process of the service's tree listens on port 9000" in second.error

"""Readiness, liveness and the start-up deadline, as scripted histories through the driver
(tests/fakes/), and whose answer a probe's answer is (driver/child_probe.py). Their real
twins: tests/integration/test_lifecycle.py, test_faults.py, test_control.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from supervisor.driver.child import ChildProcess
from supervisor.driver.child_probe import ChildProber, ProbeResult
from supervisor.policy.child_lifecycle import ChildEvent, ChildState
from supervisor.policy.plan import ServicePlan
from tests.fakes.scripted_supervisor import history, make, text


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
    assert [st for st, _ in seen] == [ChildState.READY, ChildState.NOT_READY, ChildState.READY]
    assert "a: not ready: /readyz answered 503" in text(out) and "a: ready again" in text(out)


def test_an_answer_from_another_process_is_not_readiness(tmp_path):
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=3)
    script.set("a", "/readyz", "foreign")
    assert history(s, clock, [1.0, 1.0, 1.0, 1.0]) == 3
    assert s.children[0].history == [(ChildState.PENDING, ChildEvent.STARTED, ChildState.STARTING),
                                     (ChildState.STARTING, ChildEvent.TERM, ChildState.STOPPING),
                                     (ChildState.STOPPING, ChildEvent.EXITED, ChildState.LINGERING),
                                     (ChildState.LINGERING, ChildEvent.EMPTIED, ChildState.EXITED)]  # never READY
    assert "a not ready after 3 s (last probe: /readyz on 127.0.0.1:9000 was answered by another process" in text(out)


def test_startup_timeout(tmp_path):
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=0.5)
    script.set("a", "/readyz", 503)
    assert history(s, clock, [1.0]) == 3
    assert "a not ready after 0.5 s (last probe: /readyz answered 503)" in text(out)


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


def test_a_history_replays_the_same_when_the_work_handed_to_threads_is_slow(tmp_path):
    """The scripted clock waits for the supervisor's thread work (here the port check, as
    slow as on a loaded machine) before it moves on: the history is the same as above."""
    import time

    def slow_port_check(host, port):
        time.sleep(0.2)

    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=1, port_problem=slow_port_check)
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


def _identity_case(result, *, tree=frozenset({50, 51}), listeners=frozenset(), token="t0k3n"):

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


def test_a_liveness_verdict_is_the_cause_before_a_death_queued_behind_it(tmp_path):
    """A handler's verdict is applied at once, not queued behind what already waits."""
    from supervisor.driver.service_watch import WatchRoundAnswered
    s, fake, clock, script, out = make(tmp_path, liveness_failures=1)
    missed, ok = ProbeResult(None, error="no answer within 1 s"), ProbeResult(200, b"{}")

    def verdict_then_death():
        s.port.post(WatchRoundAnswered(s.children[0], missed, ok, ok))
        fake.die("a", 5 << 8)

    assert history(s, clock, [0.5, verdict_then_death]) == 4
    assert s.unit.reason.startswith("a failed 1 liveness probes in a row")


def test_a_death_due_when_the_startup_deadline_fires_is_the_cause(tmp_path):
    """A frozen supervisor resumes with an exit and the deadline both due: the exit is reaped first."""
    s, fake, clock, script, out = make(tmp_path, startup_timeout_s=1)
    script.set("a", "/readyz", 503)

    def dies_unseen():  # the exit is there to reap; its SIGCHLD is not handled yet
        pid = fake.by_name["a"]
        fake.exits.append((pid, 5 << 8))
        os.close(fake.write_ends.pop(pid))

    assert history(s, clock, [0.5, dies_unseen, 1.0]) == 5
    assert "not ready after" not in text(out)

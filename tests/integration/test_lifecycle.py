"""The supervisor against real processes, real sockets and real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import psutil
import pytest

from tests.harness import SupervisorRun, fake_service, free_port, http_get


def test_child_exit_stops_the_unit_with_its_code(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        http_get(services["b"]["port"], "/crash?code=7")
        assert run.wait_exit(10) == 7
        out = run.output()
        assert "b: exited with code 7; stopping every service" in out
        assert "exit 7: b exited with code 7" in out
        run.assert_clean()


def test_child_killed_by_signal_gives_128_plus_n(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        os.kill(run.child_pid("a"), signal.SIGKILL)
        assert run.wait_exit(10) == 128 + signal.SIGKILL
        run.assert_clean()


def _start_slow_requests(services, names, seconds, n=4):
    results: list = []

    def call(port):
        try:
            results.append(http_get(port, f"/slow?s={seconds}", timeout=30))
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            results.append(exc)

    threads = [threading.Thread(target=call, args=(services[name]["port"],)) for name in names for _ in range(n)]
    for t in threads:
        t.start()
    return threads, results


def _in_flight(services, names) -> int:
    return sum(json.loads(http_get(services[n]["port"], "/stats")[1])["in_flight"] for n in names)


def _wait_in_flight(run, services, names, expected):
    """The precondition of every drain test: the work is really in flight (else fail)."""
    run.wait_for(f"{expected} requests in flight", lambda: _in_flight(services, names) == expected)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_stop_signal_drains_in_flight_requests_and_exits_0(tmp_path, sig):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services, grace_s=10.0) as run:  # each service's drain: 8 s
        run.wait_ready()
        threads, results = _start_slow_requests(services, ("a", "b"), 1.5)
        _wait_in_flight(run, services, ("a", "b"), 8)
        run.signal(sig)
        assert run.wait_exit(20) == 0, run.output()
        for t in threads:
            t.join(10)
        assert len(results) == 8
        assert all(isinstance(r, tuple) and r[0] == 200 for r in results), results
        out = run.output()
        for name in ("a", "b"):  # each child exited on its own, when told, within the drain
            assert re.search(rf"^onecard  \| {name}: exited with code (0|143) \(it was told to stop\)$", out, re.M), out
        assert "SIGKILL" not in out and "killed after the grace period" not in out
        assert f"{signal.Signals(sig).name} received: draining every service (drain 8 s, grace 10 s)" in out
        run.assert_clean()


def test_a_stop_while_a_model_warms_up_exits_0_at_once(tmp_path):
    """A pod deleted while its model warms up: no port is open yet, nothing was taken, so the
    service exits 0 at once. It waited for the warm-up, spent the whole drain and ended the
    unit with 75, "drain incomplete"."""
    from tests.harness import pythonpath
    warming = {"app": "tests.children.scripted_app:create_app", "port": free_port(), "threads": 1,
               "env": {"PYTHONPATH": pythonpath()}, "settings": {"warmup_sleep_s": 30.0}}
    with SupervisorRun(tmp_path, {"a": warming}, grace_s=6.0) as run:  # drain 4 s
        run.wait_for("the warm-up under way", lambda: "Waiting for application startup" in run.output())
        run.signal(signal.SIGTERM)
        assert run.wait_exit(20) == 0, run.output()  # the warm-up outlasts the drain: 75 before
        out = run.output()
        assert "a: stop signal during start-up; nothing was taken; exiting 0" in out
        assert "a: exited with code 0 (it was told to stop)" in out and "exit 0: SIGTERM received" in out
        run.assert_clean()


def test_a_drain_that_runs_out_ends_with_the_service_exiting_on_its_own_and_exit_75(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services, grace_s=4.0) as run:  # drain 2 s < grace 4 s
        run.wait_ready()
        threads, results = _start_slow_requests(services, ("a",), 30, n=2)
        _wait_in_flight(run, services, ("a",), 2)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(20) == 75
        out = run.output()
        assert "drain of 2 s ran out with 2 requests in flight" in out
        assert "a: exited with code 75 (it was told to stop)" in out  # on its own, before our SIGKILL
        assert "SIGKILL" not in out
        assert "drain incomplete (service exit codes [75])" in out
        for t in threads:
            t.join(10)
        run.assert_clean()


def test_the_drain_timeouts_nest_in_the_children_environment(tmp_path):
    services = {"a": fake_service(), "b": {**fake_service(), "drain_s": 1.5}}
    with SupervisorRun(tmp_path, services, grace_s=6.0) as run:
        run.wait_ready()
        env_a = psutil.Process(run.child_pid("a")).environ()
        env_b = psutil.Process(run.child_pid("b")).environ()
        assert float(env_a["ONECARD_DRAIN_S"]) == 4.0 < float(env_a["ONECARD_GRACE_S"]) == 6.0
        assert float(env_b["ONECARD_DRAIN_S"]) == 1.5


def test_child_ignoring_sigterm_is_killed_after_grace_and_the_unit_says_work_was_lost(tmp_path):
    services = {"stubborn": fake_service(ignore_sigterm=True), "ok": fake_service()}
    with SupervisorRun(tmp_path, services, grace_s=1.5) as run:
        run.wait_ready()
        time.sleep(0.3)  # the fake ignores SIGTERM from just after its start-up
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 75
        out = run.output()
        assert "stubborn: still running 1.5 s after SIGTERM; SIGKILL" in out
        assert "stubborn: exited with code 137 (killed after the grace period)" in out
        assert "ok: exited with code" in out and "drain incomplete (service exit codes [137])" in out
        run.assert_clean()


def test_a_service_that_exits_0_on_its_own_fails_the_unit(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        http_get(services["a"]["port"], "/exit?code=0")
        assert run.wait_exit(15) == 69
        assert "exit 69: a exited with code 0 on its own" in run.output()
        run.assert_clean()


def test_ctrl_c_while_stopping_for_a_crash_keeps_the_crash_code(tmp_path):
    services = {"crasher": fake_service(), "stubborn": fake_service(ignore_sigterm=True)}
    with SupervisorRun(tmp_path, services, grace_s=60.0) as run:
        run.wait_ready()
        time.sleep(0.3)
        http_get(services["crasher"]["port"], "/crash?code=7")
        run.wait_for("the stop to begin", lambda: "crasher: exited with code 7; stopping" in run.output())
        run.signal(signal.SIGINT)
        assert run.wait_exit(15) == 7
        assert "second SIGINT: killing every service now" in run.output()
        run.assert_clean()


def test_sigusr1_and_terminal_signals_do_not_stop_the_unit(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTOU, signal.SIGTTIN):
            run.signal(sig)
        time.sleep(0.5)
        assert run.proc.poll() is None and run.status().returncode == 0
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_second_sigint_stops_at_once(tmp_path):
    services = {"stubborn": fake_service(ignore_sigterm=True)}
    with SupervisorRun(tmp_path, services, grace_s=60.0) as run:
        run.wait_ready()
        time.sleep(0.3)
        run.signal(signal.SIGINT)
        time.sleep(0.5)
        assert run.proc.poll() is None  # still waiting for the grace period
        run.signal(signal.SIGINT)
        assert run.wait_exit(10) == 130  # long before the 60 s grace
        run.assert_clean()


def test_sigkill_of_the_supervisor_takes_every_child_down(tmp_path):
    services = {"a": fake_service(), "b": fake_service(ignore_sigterm=True)}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        children = [p for pid, p in run.seen.items() if pid != run.proc.pid]
        assert len(children) >= 2
        run.signal(signal.SIGKILL)
        run.wait_exit(5)
        t0 = time.monotonic()
        gone, alive = psutil.wait_procs(children, timeout=2.0)
        alive = [p for p in alive if not _exited(p)]  # a zombie has exited: its reaper is not the unit's
        assert not alive, f"alive {time.monotonic() - t0:.2f} s after the supervisor died: {alive}"


def _exited(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_startup_timeout_names_the_service_and_its_last_lines(tmp_path):
    services = {"late": fake_service(never_ready=True), "ok": fake_service()}
    # 6 s: on a loaded CI machine an interpreter with uvicorn has been seen to print nothing in 2 s
    with SupervisorRun(tmp_path, services, startup_timeout_s=6.0) as run:
        assert run.wait_exit(30) == 3
        out = run.output()
        assert "late not ready after 6 s" in out
        assert "Application startup complete." in out.split("late not ready after 6 s", 1)[1]
        assert "exit 3: start-up timeout: late" in out
        run.assert_clean()


def test_child_crash_during_startup_stops_the_unit(tmp_path):
    services = {"slow": fake_service(startup_delay_s=30), "bad": fake_service(crash_after_s=0, crash_code=9)}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(20) == 9
        run.assert_clean()


def test_hung_event_loop_fails_liveness(tmp_path):
    services = {"hangs": fake_service(hang_after_s=1.0), "ok": fake_service()}
    with SupervisorRun(tmp_path, services, liveness_period_s=0.3, liveness_timeout_s=0.5,
                       liveness_failures=3, grace_s=1.0) as run:
        run.wait_ready()
        assert run.wait_exit(20) == 4
        out = run.output()
        assert "hangs: liveness miss 3/3" in out
        assert "exit 4: hangs failed 3 liveness probes in a row" in out
        run.assert_clean()


def test_orphans_are_reaped_and_not_taken_for_children(tmp_path):
    services = {"parent": fake_service(orphan=True, orphan_s=0.3)}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and run.status_doc()["supervisor"]["orphans_reaped"] < 1:
            time.sleep(0.1)
        doc = run.status_doc()
        assert doc["supervisor"]["orphans_reaped"] >= 1
        assert doc["services"][0]["state"] == "ready"  # the orphan's exit was not the service's
        zombies = [p for p in psutil.Process(run.proc.pid).children() if p.status() == psutil.STATUS_ZOMBIE]
        assert not zombies
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0
        run.assert_clean()


def test_children_run_in_their_own_group_with_their_own_environment(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    services["b"]["env"]["EXTRA_FLAG"] = "on"
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        for name in ("a", "b"):
            p = psutil.Process(run.child_pid(name))
            assert os.getpgid(p.pid) == p.pid != os.getpgid(run.proc.pid)
            env = p.environ()
            assert env["ONECARD_SERVICE_NAME"] == name
            assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"
            assert env["CUDA_VISIBLE_DEVICES"] == "0"
            assert p.cmdline()[1:3] == ["-m", "services.runtime.serve"]  # a fresh interpreter
            assert ("EXTRA_FLAG" in env) == (name == "b")
            assert len(env["ONECARD_INSTANCE_TOKEN"]) == 16
            assert env["ONECARD_PROBE_SOCKET"] == f"{run.socket}.d/probes/{name}.sock"
        tokens = {psutil.Process(run.child_pid(n)).environ()["ONECARD_INSTANCE_TOKEN"] for n in ("a", "b")}
        assert len(tokens) == 2


def test_spawn_failure_exits_127(tmp_path):
    services = {"ok": fake_service(), "missing": {"command": ["/nonexistent/onecard-child"], "port": free_port()}}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(15) == 127
        assert "missing: cannot start '/nonexistent/onecard-child'" in run.output()
        run.assert_clean()


def _can_unshare_pid() -> bool:
    import shutil
    import subprocess
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs unshare --pid (root or user namespaces)")
def test_as_pid_1_it_reaps_orphans_it_did_not_start(tmp_path):
    services = {"parent": fake_service(orphan=True, orphan_s=0.3)}
    prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    with SupervisorRun(tmp_path, services, prefix=prefix) as run:
        run.wait_ready()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and run.status_doc()["supervisor"]["orphans_reaped"] < 1:
            time.sleep(0.1)
        doc = run.status_doc()
        assert doc["supervisor"]["pid"] == 1
        assert doc["supervisor"]["orphans_reaped"] >= 1
        assert doc["services"][0]["state"] == "ready"
        pid1 = psutil.Process(run.proc.pid).children()[0]  # the supervisor, PID 1 inside
        assert not [p for p in pid1.children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE]
        pid1.send_signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0
        run.assert_clean()


def test_a_service_whose_model_does_not_load_stops_the_unit_with_78(tmp_path):
    services = {"broken": {"app": "services.detect.app:create_app", "port": free_port(), "threads": 1,
                           "settings": {"backend": "haar", "haar_cascade": "/nonexistent/cascade.xml"}},
                "ok": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(60) == 78
        out = run.output()
        assert "cannot load the Haar cascade /nonexistent/cascade.xml" in out
        assert "broken: exited with code 78; stopping every service" in out
        run.assert_clean()


def test_a_service_whose_app_cannot_be_imported_stops_the_unit_with_78(tmp_path):
    services = {"bad": {**fake_service(), "app": "tests.children.no_such_module:create_app"}, "ok": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(60) == 78
        out = run.output()
        assert "bad: exited with code 78; stopping every service" in out
        assert "no_such_module" in out
        run.assert_clean()


def test_cpu_seconds_never_go_back_when_a_process_of_the_tree_exits(tmp_path):
    services = {"a": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        seen = []
        for _ in range(3):
            http_get(services["a"]["port"], "/burn?s=0.4", timeout=30)  # CPU in a child that then exits
            for _ in range(4):
                svc = run.service("a")
                seen.append((svc["cpu_seconds"], svc["cpu_percent"]))
                time.sleep(0.3)
        cpu = [c for c, _ in seen if c is not None]
        assert len(cpu) >= 6 and cpu == sorted(cpu), seen
        assert cpu[-1] - cpu[0] >= 0.8  # the burning children's CPU stays counted after they exit
        assert all(p is None or p >= 0 for _, p in seen), seen
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0

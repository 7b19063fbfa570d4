"""The supervisor against real processes, real sockets and real signals."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from tests.harness import SupervisorRun, fake_service, free_port, http_get


def _assert_clean(run: SupervisorRun) -> None:
    left = run.wait_no_leftovers()
    assert not left, f"left behind: {[(p.pid, p.status()) for p in left]}"


def test_child_exit_stops_the_unit_with_its_code(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        b_port = services["b"]["port"]
        t0 = time.monotonic()
        http_get(b_port, "/crash?code=7")
        assert run.wait_exit(10) == 7
        assert time.monotonic() - t0 < 5
        out = run.output()
        assert "b: exited with code 7; stopping every service" in out
        assert "exit 7: b exited with code 7" in out
        _assert_clean(run)


def test_child_killed_by_signal_gives_128_plus_n(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        os.kill(run.child_pid("a"), signal.SIGKILL)
        assert run.wait_exit(10) == 128 + signal.SIGKILL
        _assert_clean(run)


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services, grace_s=10.0) as run:
        run.wait_ready()
        results: list = []

        def call(port):
            try:
                results.append(http_get(port, "/slow?s=1.5", timeout=20))
            except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                results.append(exc)

        threads = [threading.Thread(target=call, args=(services[n]["port"],)) for n in ("a", "b") for _ in range(4)]
        for t in threads:
            t.start()
        # every request in flight before the signal
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sum(s["in_flight"] or 0 for s in run.status_doc()["services"]) == 8:
                break
            time.sleep(0.05)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0
        for t in threads:
            t.join(5)
        assert len(results) == 8
        assert all(isinstance(r, tuple) and r[0] == 200 for r in results), results
        _assert_clean(run)


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path):
    services = {"stubborn": fake_service(ignore_sigterm=True), "ok": fake_service()}
    with SupervisorRun(tmp_path, services, grace_s=1.5) as run:
        run.wait_ready()
        time.sleep(0.3)
        t0 = time.monotonic()
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0
        took = time.monotonic() - t0
        assert 1.4 <= took < 8, took
        assert "stubborn: still running 1.5 s after SIGTERM; SIGKILL" in run.output()
        _assert_clean(run)


def test_second_sigint_stops_at_once(tmp_path):
    services = {"stubborn": fake_service(ignore_sigterm=True)}
    with SupervisorRun(tmp_path, services, grace_s=60.0) as run:
        run.wait_ready()
        time.sleep(0.3)
        run.signal(signal.SIGINT)
        time.sleep(0.5)
        assert run.proc.poll() is None  # still waiting for the grace period
        t0 = time.monotonic()
        run.signal(signal.SIGINT)
        assert run.wait_exit(10) == 130
        assert time.monotonic() - t0 < 5
        _assert_clean(run)


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
        assert not alive, f"alive {time.monotonic() - t0:.2f} s after the supervisor died: {alive}"


def test_startup_timeout_names_the_service_and_its_last_lines(tmp_path):
    services = {"late": fake_service(never_ready=True), "ok": fake_service()}
    with SupervisorRun(tmp_path, services, startup_timeout_s=2.0) as run:
        assert run.wait_exit(20) == 3
        out = run.output()
        assert "late not ready after 2 s" in out
        assert "Application startup complete." in out.split("late not ready after 2 s", 1)[1]
        assert "exit 3: start-up timeout: late" in out
        _assert_clean(run)


def test_child_crash_during_startup_stops_the_unit(tmp_path):
    services = {"slow": fake_service(startup_delay_s=30), "bad": fake_service(crash_after_s=0, crash_code=9)}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(20) == 9
        _assert_clean(run)


def test_hung_event_loop_fails_liveness(tmp_path):
    services = {"hangs": fake_service(hang_after_s=1.0), "ok": fake_service()}
    with SupervisorRun(tmp_path, services, liveness_period_s=0.3, liveness_timeout_s=0.5,
                       liveness_failures=3, grace_s=1.0) as run:
        run.wait_ready()
        assert run.wait_exit(20) == 4
        out = run.output()
        assert "hangs: liveness miss 3/3" in out
        assert "exit 4: hangs failed 3 liveness probes in a row" in out
        _assert_clean(run)


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
        _assert_clean(run)


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


def test_spawn_failure_exits_127(tmp_path):
    services = {"ok": fake_service(), "missing": {"command": ["/nonexistent/onecard-child"], "port": free_port()}}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(15) == 127
        assert "missing: cannot start '/nonexistent/onecard-child'" in run.output()
        _assert_clean(run)


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
        _assert_clean(run)


def test_a_service_whose_model_does_not_load_stops_the_unit_with_78(tmp_path):
    services = {"broken": {"app": "services.detect.app:create_app", "port": free_port(), "threads": 1,
                           "settings": {"backend": "haar", "haar_cascade": "/nonexistent/cascade.xml"}},
                "ok": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(60) == 78
        out = run.output()
        assert "cannot load the Haar cascade /nonexistent/cascade.xml" in out
        assert "broken: exited with code 78; stopping every service" in out
        _assert_clean(run)

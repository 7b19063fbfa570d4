"""GPU and CPU resources against real processes: the MPS lifecycle with a stand-in
control binary that records its calls, the no-GPU state, real cgroup throttling figures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil

from tests.harness import ROOT, SupervisorRun, fake_service, http_get

FAKE_MPS = ROOT / "tests" / "children" / "fake_mps"
FAKE_NVML = ROOT / "tests" / "children" / "fake_nvml"


def nvml_env(spec: str) -> dict[str, str]:
    """The supervisor imports the stand-in NVML: no GPU, or the cards we say."""
    return {"PYTHONPATH": f"{FAKE_NVML}:{ROOT}", "FAKE_NVML": spec}


def mps_env(tmp_path, **extra) -> dict[str, str]:
    return {"PATH": f"{FAKE_MPS}:{os.environ['PATH']}", "FAKE_MPS_LOG": str(tmp_path / "mps.log"), **extra}


def records(tmp_path) -> list[dict]:
    path = tmp_path / "mps.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def calls(tmp_path) -> list[dict]:
    """Invocations of the control binary (the daemon's own records left out)."""
    return [r for r in records(tmp_path) if "argv" in r]


def daemon_pid(tmp_path) -> int:
    return next(r["daemon_pid"] for r in records(tmp_path) if "daemon_pid" in r)


def mps_run(tmp_path, services, env=None, gpu=None, **kw) -> SupervisorRun:
    return SupervisorRun(tmp_path, services, env=env or mps_env(tmp_path),
                         gpu={"mps": True, "mps_dir": str(tmp_path / "mps"), **(gpu or {})}, **kw)


def gone(pid: int) -> bool:
    """Not running and not a zombie: someone reaped it."""
    try:
        psutil.Process(pid).status()  # a zombie still has a status: not gone
    except psutil.NoSuchProcess:
        return True
    return False


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


def test_mps_starts_before_the_services_and_quits_after_them(tmp_path):
    services = {"a": {**fake_service(), "mps_thread_percentage": 30}, "b": fake_service()}
    with mps_run(tmp_path, services) as run:
        run.wait_ready()
        out = run.output()
        assert out.index("MPS: control daemon started") < out.index("a: started pid")
        first = calls(tmp_path)
        assert len(first) == 1 and first[0]["argv"] == ["-d"]
        assert first[0]["pipe_dir"] == str(tmp_path / "mps" / "pipe")
        assert first[0]["log_dir"] == str(tmp_path / "mps" / "log")
        assert os.stat(tmp_path / "mps" / "pipe").st_mode & 0o777 == 0o700
        env_a = psutil.Process(run.child_pid("a")).environ()
        env_b = psutil.Process(run.child_pid("b")).environ()
        assert env_a["CUDA_MPS_PIPE_DIRECTORY"] == env_b["CUDA_MPS_PIPE_DIRECTORY"] == first[0]["pipe_dir"]
        assert env_a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env_b
        # the detached daemon is a supervised child of the supervisor
        pid = daemon_pid(tmp_path)
        assert psutil.Process(pid).ppid() == run.proc.pid
        mps = run.status_doc()["mps"]
        assert mps["enabled"] and mps["running"] and mps["pid"] == pid and mps["state"] == "ready"
        assert mps["pipe_dir"] == first[0]["pipe_dir"]
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0
        out = run.output()
        assert out.index("a: exited") < out.index("MPS: control daemon stopped")
        assert out.index("b: exited") < out.index("MPS: control daemon stopped")
        last = calls(tmp_path)[-1]
        assert last["argv"] == [] and last["stdin"] == "quit\n"
        assert not (tmp_path / "mps" / "pipe" / "control").exists()
        assert wait_gone(pid), "the daemon is still there (or left as a zombie)"


def test_mps_quits_when_a_service_crashes(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with mps_run(tmp_path, services) as run:
        run.wait_ready()
        pid = daemon_pid(tmp_path)
        http_get(services["a"]["port"], "/crash?code=6")
        assert run.wait_exit(15) == 6
        assert calls(tmp_path)[-1]["stdin"] == "quit\n"
        assert wait_gone(pid)


def test_mps_quits_after_a_startup_timeout(tmp_path):
    with mps_run(tmp_path, {"late": fake_service(never_ready=True)}, startup_timeout_s=1.0) as run:
        assert run.wait_exit(20) == 3
        assert calls(tmp_path)[-1]["stdin"] == "quit\n"
        assert wait_gone(daemon_pid(tmp_path))


def test_mps_quits_after_a_second_sigint(tmp_path):
    services = {"stubborn": fake_service(ignore_sigterm=True)}
    with mps_run(tmp_path, services, grace_s=60.0) as run:
        run.wait_ready()
        run.signal(signal.SIGINT)
        run.wait_for("the drain to begin", lambda: "draining every service" in run.output())
        run.signal(signal.SIGINT)
        assert run.wait_exit(15) == 130
        assert calls(tmp_path)[-1]["stdin"] == "quit\n"
        assert wait_gone(daemon_pid(tmp_path))


def test_daemon_death_stops_the_unit_with_6_and_costs_no_quit(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with mps_run(tmp_path, services) as run:
        run.wait_ready()
        pid = daemon_pid(tmp_path)
        before = len(calls(tmp_path))
        os.kill(pid, signal.SIGKILL)
        assert run.wait_exit(15) == 6
        out = run.output()
        assert "mps: exited with code 137; stopping every service" in out
        assert "exit 6: the MPS control daemon died (code 137)" in out
        assert len(calls(tmp_path)) == before, "a dead daemon was sent quit"
        assert not (tmp_path / "mps" / "pipe" / "control").exists()  # its stale socket is removed
        assert gone(pid)  # reaped by the supervisor, not left a zombie
        assert not run.wait_no_leftovers()


def test_live_daemon_from_an_earlier_run_is_told_to_quit_first(tmp_path):
    env = {**os.environ, **mps_env(tmp_path), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "log")}
    (tmp_path / "mps" / "pipe").mkdir(parents=True)
    (tmp_path / "mps" / "log").mkdir(parents=True)
    subprocess.run([str(FAKE_MPS / "nvidia-cuda-mps-control"), "-d"], env=env, check=True, timeout=10)
    old = daemon_pid(tmp_path)
    try:
        deadline = time.monotonic() + 5
        while not (tmp_path / "mps" / "pipe" / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with mps_run(tmp_path, {"a": fake_service()}) as run:
            run.wait_ready()
            seen = calls(tmp_path)
            assert [c["argv"] for c in seen[1:3]] == [[], ["-d"]]
            assert seen[1]["stdin"] == "quit\n" and seen[1]["control_existed"]
            assert "a daemon from an earlier run holds" in run.output()
            assert wait_gone(old)
    finally:
        try:
            os.kill(old, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_dead_daemon_from_an_earlier_run_costs_no_quit(tmp_path):
    pipe = tmp_path / "mps" / "pipe"
    pipe.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(pipe / "control"))  # a socket file nobody listens on: its daemon died
    stale.close()
    with mps_run(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        assert [c["argv"] for c in calls(tmp_path)] == [["-d"]]  # no quit sent to the dead one
        assert "a daemon from an earlier run holds" not in run.output()


def test_daemon_that_will_not_start_is_a_clear_error(tmp_path):
    with mps_run(tmp_path, {"a": fake_service()}, env=mps_env(tmp_path, FAKE_MPS_FAIL="1")) as run:
        assert run.wait_exit(20) == 5
        out = run.output()
        assert ("MPS: nvidia-cuda-mps-control -d failed with code 1: An instance of this daemon is already running"
                in out)
        assert "a: started" not in out  # nothing was started


def test_daemon_without_a_control_socket_times_out_clearly_and_is_not_left_behind(tmp_path):
    with mps_run(tmp_path, {"a": fake_service()}, env=mps_env(tmp_path, FAKE_MPS_NO_PIPE="1"),
                 gpu={"mps_start_timeout_s": 0.5}) as run:
        assert run.wait_exit(20) == 5
        assert "did not create" in run.output() and "within 0.5 s" in run.output()
        assert "a: started" not in run.output()
        assert wait_gone(daemon_pid(tmp_path)), "the daemon that never opened its socket was left running"


def test_daemon_that_ignores_quit_is_killed(tmp_path):
    with mps_run(tmp_path, {"a": fake_service()}, env=mps_env(tmp_path, FAKE_MPS_IGNORE_QUIT="1"),
                 gpu={"mps_stop_timeout_s": 0.5}) as run:
        run.wait_ready()
        pid = daemon_pid(tmp_path)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0
        assert "MPS: the control daemon did not quit within 0.5 s; SIGKILL" in run.output()
        assert wait_gone(pid)


def test_missing_mps_binary_is_an_error_at_check_and_at_start(tmp_path):
    run = SupervisorRun(tmp_path, {"a": fake_service()}, gpu={"mps": True})
    empty = tmp_path / "empty-path"
    empty.mkdir()  # a PATH without the binary, even on a GPU host that has it
    env = {**os.environ, "PATH": str(empty), "PYTHONPATH": str(ROOT)}
    for cmd in ("check", "run"):
        r = subprocess.run([sys.executable, "-m", "supervisor", cmd, "--config", str(run.config)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "gpu.mps: [gpu] mps = true, but nvidia-cuda-mps-control is not on PATH" in r.stderr


def test_no_gpu_is_a_clean_state_everywhere(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}, env=nvml_env("absent")) as run:
        run.wait_ready()
        gpu = run.wait_for("a GPU sample", lambda: run.status_doc()["gpu"] if run.status_doc()["supervisor"][
            "sampled_s_ago"] is not None else None)
        assert gpu == {"available": False, "reason": "NVML unavailable: NVMLError_LibraryNotFound: "
                                                     "NVML Shared Library Not Found"}
        assert "gpu  none (" in run.status().stdout
        metrics = httpx.get(f"http://127.0.0.1:{run.health_port}/metrics").text
        assert "onecard_gpu_available 0" in metrics
        r = run.cli("check", "--config", str(run.config), env=nvml_env("absent"))
        assert r.returncode == 0 and "gpu  none (NVML unavailable" in r.stdout
        assert "Traceback" not in run.output() + r.stderr


def test_gpu_facts_and_budgets_come_from_the_visible_card(tmp_path):
    svc = {**fake_service(), "gpu_memory_bytes": 20 * 2**30}
    run = SupervisorRun(tmp_path, {"a": svc}, gpu={"visible_devices": "1"}, env=nvml_env("16,80"))
    r = run.cli("check", "--config", str(run.config), env=nvml_env("16,80"))
    assert r.returncode == 0, r.stderr  # 20 GiB of card 1's 80
    assert "gpu  Fake GPU 1, 1.0 / 80.0 GiB used" in r.stdout
    r = run.cli("check", "--config", str(run.config), "--set", 'gpu.visible_devices="0"', env=nvml_env("16,80"))
    assert r.returncode == 2 and "budgets add up to 1.25 of the card" in r.stderr  # 20 of card 0's 16
    with run:
        run.wait_ready()
        gpu = run.wait_for("a GPU sample", lambda: run.status_doc()["gpu"] if run.status_doc()["gpu"].get(
            "available") else None)
        assert gpu["name"] == "Fake GPU 1" and gpu["memory_total_bytes"] == 80 * 2**30


def test_real_cgroup_quota_and_throttling_are_reported(tmp_path):
    from supervisor.system.cpu_cgroup import read_cpu_quota, read_cpu_stat
    quota = read_cpu_quota()
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        cpu = run.status_doc()["cpu"]
        assert cpu["cpus"] == quota.cpus and cpu["source"] == quota.source
        assert cpu["threads_planned"] == 1
        if read_cpu_stat(quota) is not None:  # the cgroup exposes cpu.stat here
            thr = cpu["throttling"]
            assert {"nr_periods", "nr_throttled", "throttled_s", "throttled_share_1m", "throttled_s_1m"} <= set(thr)
            metrics = httpx.get(f"http://127.0.0.1:{run.health_port}/metrics").text
            assert "onecard_cpu_throttled_periods_total" in metrics and "onecard_cpu_throttled_share_1m" in metrics
        assert f"onecard_cpu_quota_cpus {quota.cpus:g}" in httpx.get(
            f"http://127.0.0.1:{run.health_port}/metrics").text

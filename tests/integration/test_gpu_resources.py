"""GPU and CPU resources against real processes: the MPS lifecycle with a stand-in
control binary that records its calls, the no-GPU state, real cgroup throttling figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from tests.harness import ROOT, SupervisorRun, fake_service, http_get

FAKE_MPS = ROOT / "tests" / "children" / "fake_mps"


def mps_env(tmp_path, **extra) -> dict[str, str]:
    return {"PATH": f"{FAKE_MPS}:{os.environ['PATH']}", "FAKE_MPS_LOG": str(tmp_path / "mps.log"), **extra}


def calls(tmp_path) -> list[dict]:
    path = tmp_path / "mps.log"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def mps_run(tmp_path, services, env=None, **kw) -> SupervisorRun:
    return SupervisorRun(tmp_path, services, env=env or mps_env(tmp_path),
                         gpu={"mps": True, "mps_dir": str(tmp_path / "mps")}, **kw)


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
        import psutil
        env_a = psutil.Process(run.child_pid("a")).environ()
        env_b = psutil.Process(run.child_pid("b")).environ()
        assert env_a["CUDA_MPS_PIPE_DIRECTORY"] == env_b["CUDA_MPS_PIPE_DIRECTORY"] == first[0]["pipe_dir"]
        assert env_a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env_b
        assert run.status_doc()["mps"] == {"enabled": True, "running": True, "pipe_dir": first[0]["pipe_dir"]}
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0
        out = run.output()
        assert out.index("a: exited") < out.index("MPS: control daemon stopped")
        assert out.index("b: exited") < out.index("MPS: control daemon stopped")
        last = calls(tmp_path)[-1]
        assert last["argv"] == [] and last["stdin"] == "quit\n"
        assert not (tmp_path / "mps" / "pipe" / "control").exists()


def test_mps_quits_when_a_service_crashes(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with mps_run(tmp_path, services) as run:
        run.wait_ready()
        http_get(services["a"]["port"], "/crash?code=6")
        assert run.wait_exit(15) == 6
        assert calls(tmp_path)[-1]["stdin"] == "quit\n"


def test_mps_quits_after_a_startup_timeout(tmp_path):
    with mps_run(tmp_path, {"late": fake_service(never_ready=True)}, startup_timeout_s=1.0) as run:
        assert run.wait_exit(20) == 3
        assert calls(tmp_path)[-1]["stdin"] == "quit\n"


def test_stale_daemon_from_an_earlier_crash_is_told_to_quit_first(tmp_path):
    pipe = tmp_path / "mps" / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "control").write_text("")  # left by a supervisor that was SIGKILLed
    with mps_run(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        seen = calls(tmp_path)
        assert [c["argv"] for c in seen[:2]] == [[], ["-d"]]
        assert seen[0]["stdin"] == "quit\n" and seen[0]["control_existed"]
        assert "a daemon from an earlier run holds" in run.output()


def test_daemon_that_will_not_start_is_a_clear_error(tmp_path):
    with mps_run(tmp_path, {"a": fake_service()}, env=mps_env(tmp_path, FAKE_MPS_FAIL="1")) as run:
        assert run.wait_exit(20) == 5
        out = run.output()
        assert "MPS: nvidia-cuda-mps-control -d failed with code 1: An instance of this daemon is already running" in out
        assert "a: started" not in out  # nothing was started


def test_daemon_without_a_control_pipe_times_out_clearly(tmp_path):
    env = mps_env(tmp_path, FAKE_MPS_NO_PIPE="1")
    run = SupervisorRun(tmp_path, {"a": fake_service()}, env=env,
                        gpu={"mps": True, "mps_dir": str(tmp_path / "mps"), "mps_start_timeout_s": 0.5})
    with run:
        assert run.wait_exit(20) == 5
        assert "did not create" in run.output() and "within 0.5 s" in run.output()


def test_missing_mps_binary_is_an_error_at_check_and_at_start(tmp_path):
    run = SupervisorRun(tmp_path, {"a": fake_service()}, gpu={"mps": True})
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    for cmd in ("check", "run"):
        r = subprocess.run([sys.executable, "-m", "supervisor", cmd, "--config", str(run.config)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "gpu.mps: [gpu] mps = true, but nvidia-cuda-mps-control is not on PATH" in r.stderr


def test_no_gpu_is_a_clean_state_everywhere(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        gpu = run.status_doc()["gpu"]
        assert gpu["available"] is False and gpu["reason"]
        assert "gpu  none (" in run.status().stdout
        metrics = httpx.get(f"http://127.0.0.1:{run.health_port}/metrics").text
        assert "onecard_gpu_available 0" in metrics
        r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(run.config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "gpu  none (" in r.stdout
        assert "Traceback" not in run.output() + r.stderr


def test_real_cgroup_quota_and_throttling_are_reported(tmp_path):
    from supervisor.cpuquota import read_cpu_quota, read_cpu_stat
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

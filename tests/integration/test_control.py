"""`onecard status`, the control socket, the probe port and the log stream."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

from tests.harness import ROOT, SupervisorRun, fake_service, http_get

STATUS_KEYS = {"name", "pid", "host", "port", "state", "ready", "uptime_s", "exit_code", "threads",
               "liveness_misses", "last_probe_error", "cpu_percent", "cpu_seconds", "rss_bytes",
               "gpu_memory_bytes", "gpu_memory_source", "queue_depth", "in_flight", "served", "errors",
               "latency_p50_ms", "latency_p99_ms",
               # added after version 1 shipped (keys are only ever added)
               "drain_s", "killed", "jobs"}


def test_status_table_json_and_exit_codes(tmp_path):
    services = {"fast": fake_service(), "slow": fake_service(startup_delay_s=3.0)}
    with SupervisorRun(tmp_path, services) as run:
        # not all ready yet: exit 1, and the probe port says who is not
        deadline = time.monotonic() + 10
        while True:
            r = run.status()
            if r.returncode == 1 and "fast" in r.stdout:
                break
            assert time.monotonic() < deadline, (r.returncode, r.stdout, r.stderr)
            time.sleep(0.05)
        code, body = http_get(run.health_port, "/readyz")
        assert code == 503 and "slow (starting)" in json.loads(body)["not_ready"]

        run.wait_ready()
        time.sleep(1.2)  # one liveness period: /stats figures and CPU % sampled
        r = run.status()
        assert r.returncode == 0
        header, *rows = r.stdout.splitlines()
        for col in ("SERVICE", "PID", "PORT", "STATE", "UPTIME", "CPU%", "RSS", "GPU MEM",
                    "QUEUE", "INFLIGHT", "SERVED", "P50 MS", "P99 MS"):
            assert col in header
        assert any(row.startswith("fast") and " ready " in row for row in rows)
        doc = run.status_doc()
        assert doc["version"] == 1 and doc["supervisor"]["all_ready"] is True
        for s in doc["services"]:
            assert set(s) == STATUS_KEYS
            assert s["ready"] and s["rss_bytes"] > 1_000_000 and s["latency_p99_ms"] == 2.5
        assert {"cpus", "source", "affinity", "quota"} <= set(doc["cpu"])
        assert http_get(run.health_port, "/readyz")[0] == 200

        t0 = time.monotonic()
        run.status()
        assert time.monotonic() - t0 < 2.0  # generous; bench/ measures the real figure

        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0
    r = subprocess.run([sys.executable, "-m", "supervisor", "status", "--socket", run.socket],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no onecard supervisor" in r.stderr


def test_control_socket_is_private(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        assert stat.S_IMODE(os.stat(run.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(run.socket)).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(run.socket).st_mode)


def test_probe_port_healthz_and_metrics(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        time.sleep(0.8)
        assert http_get(run.health_port, "/healthz")[0] == 200
        assert http_get(run.health_port, "/status")[0] == 404  # no detail on the network port
        code, body = http_get(run.health_port, "/metrics")
        text = body.decode()
        assert code == 200
        for name in ("a", "b"):
            assert f'onecard_service_up{{service="{name}"}} 1' in text
            assert f'onecard_service_state{{service="{name}",state="ready"}} 1' in text
            assert f'onecard_service_exits_total{{service="{name}"}} 0' in text
            assert f'onecard_service_cpu_seconds_total{{service="{name}"}}' in text
            assert f'onecard_service_rss_bytes{{service="{name}"}}' in text
        assert "onecard_ready 1" in text


def test_stale_socket_from_a_dead_supervisor_is_replaced(tmp_path):
    first = SupervisorRun(tmp_path, {"a": fake_service()})
    with first:
        first.wait_ready()
        first.signal(signal.SIGKILL)
        first.wait_exit(5)
    assert os.path.exists(first.socket)  # SIGKILL left it behind
    second = SupervisorRun(tmp_path, {"a": fake_service()})
    with second:
        second.wait_ready()


def test_second_supervisor_on_the_same_socket_is_refused(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as first:
        first.wait_ready()
        second = SupervisorRun(tmp_path, {"a": fake_service()})
        with second:
            assert second.wait_exit(20) == 1
            assert "another onecard supervisor is running" in second.output()
        assert first.status().returncode == 0


def test_every_line_is_tagged_and_nothing_is_lost_at_shutdown(tmp_path):
    script = ("import sys,time\n"
              "for i in range(2000): print(f'line {i}', flush=(i % 100 == 0))\n"
              "sys.stdout.write('partial-last-line-without-newline'); sys.stdout.flush()\n"
              "sys.exit(5)\n")
    services = {"talker": {"command": [sys.executable, "-c", script], "port": 1}}
    with SupervisorRun(tmp_path, services) as run:
        assert run.wait_exit(20) == 5
        lines = [l for l in run.output().splitlines() if l.startswith("talker ")]
        got = [l.split(" | ", 1)[1] for l in lines]
        assert got[:2000] == [f"line {i}" for i in range(2000)]
        assert got[2000] == "partial-last-line-without-newline"


def test_json_log_format(tmp_path):
    services = {"a": fake_service()}
    with SupervisorRun(tmp_path, services, extra_args=["--log-format", "json"]) as run:
        run.wait_ready()
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0
        records = [json.loads(l) for l in run.output().splitlines() if l.strip()]
        assert {r["source"] for r in records} == {"onecard", "a"}
        assert all({"ts", "source", "level", "msg"} <= set(r) for r in records)
        assert any(r["source"] == "a" and "Application startup complete." in r["msg"] for r in records)


def test_status_watch_refreshes_until_ctrl_c(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        p = subprocess.Popen([sys.executable, "-m", "supervisor", "status", "--socket", run.socket, "--watch",
                              "--interval", "0.2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            time.sleep(2.0)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, err
        assert out.count("SERVICE") >= 3 and "Traceback" not in err

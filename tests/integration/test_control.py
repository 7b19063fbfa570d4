"""`onecard status`, the control socket, the probe port and the log stream."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import psutil

from tests.harness import ROOT, SupervisorRun, fake_service, http_get

STATUS_KEYS = {"name", "pid", "host", "port", "state", "ready", "uptime_s", "exit_code", "threads",
               "liveness_misses", "last_probe_error", "cpu_percent", "cpu_seconds", "rss_bytes",
               "gpu_memory_bytes", "gpu_memory_source", "queue_depth", "in_flight", "served", "errors",
               "latency_p50_ms", "latency_p99_ms",
               # added after version 1 shipped (keys are only ever added)
               "drain_s", "killed", "jobs", "batching"}


def test_status_table_json_and_exit_codes(tmp_path):
    services = {"fast": fake_service(), "slow": fake_service(startup_delay_s=3.0)}
    with SupervisorRun(tmp_path, services) as run:
        # not all ready yet: exit 1, and the probe port says who is not (on a loaded machine
        # both may still be pending at first: slow is starting for its 3 s after that)
        deadline = time.monotonic() + 10
        while True:
            r = run.status()
            code, body = http_get(run.health_port, "/readyz") if r.returncode == 1 and "fast" in r.stdout \
                else (None, "{}")
            if code is not None and "slow (starting)" in json.loads(body)["not_ready"]:
                break
            assert time.monotonic() < deadline, (r.returncode, r.stdout, r.stderr, code, body)
            time.sleep(0.05)
        assert code == 503

        run.wait_ready()
        # a liveness period reads /stats; a sampling period measures RSS
        run.wait_for("figures from /stats and the sampler", lambda: all(
            s["latency_p99_ms"] is not None and s["rss_bytes"] for s in run.status_doc()["services"]))
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
        # when this supervisor started (a restart shows as a new value), the same at every scrape
        started = float(text.split("\nprocess_start_time_seconds ")[1].split()[0])
        assert abs(started - time.time()) < 120
        assert http_get(run.health_port, "/metrics")[1].decode().count(f"process_start_time_seconds {started:.3f}") == 1


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
        lines = [line for line in run.output().splitlines() if line.startswith("talker ")]
        got = [line.split(" | ", 1)[1] for line in lines]
        assert got[:2000] == [f"line {i}" for i in range(2000)]
        assert got[2000] == "partial-last-line-without-newline"


def test_json_log_format(tmp_path):
    services = {"a": fake_service()}
    with SupervisorRun(tmp_path, services, extra_args=["--log-format", "json"]) as run:
        run.wait_ready()
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0
        records = [json.loads(line) for line in run.output().splitlines() if line.strip()]
        assert {r["source"] for r in records} == {"onecard", "a"}
        assert all({"ts", "source", "level", "msg"} <= set(r) for r in records)
        assert any(r["source"] == "a" and "Application startup complete." in r["msg"] for r in records)


def _default_sigint() -> None:
    # A shell running pytest in the background ignores SIGINT, and an ignored signal is
    # inherited: give the child the default disposition, as a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_refreshes_count_times(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        r = run.cli("status", "--socket", run.socket, "--watch", "--interval", "0.1", "--count", "3")
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("SERVICE") == 3 and "Traceback" not in r.stderr


def test_status_watch_ends_cleanly_on_ctrl_c(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        p = subprocess.Popen([sys.executable, "-m", "supervisor", "status", "--socket", run.socket, "--watch",
                              "--interval", "0.1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_default_sigint)
        try:
            first = p.stdout.readline()  # it is watching: the first refresh is out
            assert first, p.stderr.read()
            p.send_signal(signal.SIGINT)
            p.wait(timeout=10)
            out, err = first + p.stdout.read(), p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()
        assert p.returncode == 0, err
        assert "SERVICE" in out and "Traceback" not in err


def test_status_and_stop_find_the_socket_through_onecard_config(tmp_path):
    """Inside a container: the config sets a custom socket, ONECARD_CONFIG names the config,
    and `status` / `stop` run from any directory with no option."""
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        env = {"ONECARD_CONFIG": str(run.config)}
        r = run.cli("status", "--json", env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["supervisor"]["pid"] == run.proc.pid
        r = run.cli("stop", env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"supervisor pid {run.proc.pid} is stopping" in r.stdout and "stopped" in r.stdout
        assert run.wait_exit(10) == 0
        assert "`onecard stop` requested: draining every service" in run.output()
        r = run.cli("status", env=env, cwd=tmp_path)
        assert r.returncode == 2 and "no onecard supervisor" in r.stderr
        r = run.cli("stop", env=env, cwd=tmp_path)
        assert r.returncode == 2


def test_status_names_a_missing_onecard_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervisor", "status"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT),
                                        "ONECARD_CONFIG": str(tmp_path / "absent.toml")})
    assert r.returncode == 2 and f"ONECARD_CONFIG={tmp_path / 'absent.toml'}: no such file" in r.stderr


def test_a_ready_service_whose_readyz_fails_is_not_ready_everywhere(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        http_get(services["a"]["port"], "/ready?on=0")
        run.wait_for("a not_ready in status", lambda: run.service("a")["state"] == "not_ready")
        assert run.status().returncode == 1
        code, body = http_get(run.health_port, "/readyz")
        assert code == 503 and json.loads(body)["not_ready"] == ["a (not_ready)"]
        assert "a: not ready: /readyz answered 503" in run.output()
        http_get(services["a"]["port"], "/ready?on=1")
        run.wait_for("a ready again", lambda: run.service("a")["state"] == "ready")
        assert http_get(run.health_port, "/readyz")[0] == 200 and run.status().returncode == 0
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_jobs_section_is_passed_through(tmp_path):
    jobs = {"queued": 3, "running": 1, "done": 40, "streams": ["a", "b"]}
    services = {"jobs": fake_service(jobs=jobs), "plain": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        run.wait_for("the jobs section", lambda: run.service("jobs")["jobs"])
        assert run.service("jobs")["jobs"] == jobs and run.service("plain")["jobs"] is None
        assert "jobs jobs  done 40, queued 3, running 1" in run.status().stdout


def test_metrics_are_valid_prometheus_text(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from supervisor.version import __version__
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        run.wait_for("a sample", lambda: run.service("a")["rss_bytes"])
        code, body = http_get(run.health_port, "/metrics")
        text = body.decode()
        assert code == 200
        families = list(text_string_to_metric_families(text))
        names = [f.name for f in families]
        assert len(names) == len(set(names)), "a family appears twice"
        helps = [line for line in text.splitlines() if line.startswith("# HELP ")]
        types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(helps) == len(types) == len(families)
        for line in types:
            _, _, name, kind = line.split()
            if kind == "counter":
                assert name.endswith("_total"), name
        info = next(f for f in families if f.name == "onecard_build_info")
        assert info.samples[0].labels["version"] == __version__ and info.samples[0].value == 1
        assert info.samples[0].labels["python"] == __import__("platform").python_version()
        if shutil.which("promtool"):  # Debian: prometheus; the same checks a scrape config review runs
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr


def test_the_control_socket_in_an_existing_directory_leaves_it_alone(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    os.chmod(shared, 0o755)  # like /run: not ours to change
    run = SupervisorRun(tmp_path, {"a": fake_service()}, control_socket=str(shared / "onecard.sock"))
    run.socket = str(shared / "onecard.sock")
    with run:
        run.wait_ready()
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(run.socket).st_mode) == 0o600
        private = shared / "onecard.sock.d"
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700  # what the supervisor made is private
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755


def test_a_run_directory_that_is_not_private_is_refused_not_changed(tmp_path):
    run = SupervisorRun(tmp_path, {"a": fake_service()})
    loose = tmp_path / "ctl" / "c.sock.d"
    loose.mkdir(parents=True)
    os.chmod(loose, 0o755)
    with run:
        assert run.wait_exit(20) == 1
        assert "mode 0755, expected a private 0700 directory" in run.output()
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o755


def test_a_deleted_control_socket_is_created_again(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        os.unlink(run.socket)
        run.wait_for("the socket to be created again", lambda: "was removed; created it again" in run.output())
        assert run.status().returncode == 0
        assert stat.S_IMODE(os.stat(run.socket).st_mode) == 0o600
        assert "was removed; created it again" in run.output()


def test_a_stuck_stdout_never_stalls_supervision(tmp_path):
    """stdout is a pipe nobody reads (a stuck log driver) and a service prints a lot: status
    still answers, a death is still noticed, and the lines dropped are counted."""
    # talker ignores SIGTERM: the stop lasts grace_s, time to see it happen with stdout still stuck
    services = {"talker": fake_service(chatter_lines_s=2000, ignore_sigterm=True), "victim": fake_service()}
    run = SupervisorRun(tmp_path, services, log_buffer_lines=200, grace_s=6.0)
    run._log = open(os.devnull, "wb")  # this run's stdout is the unread pipe below, not the harness's file
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(run.config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    run.proc = proc
    try:
        def status_doc():
            r = run.status("--json")
            return json.loads(r.stdout) if r.returncode in (0, 1) else None
        run.wait_for("the unit to be ready behind a stuck stdout", lambda: (status_doc() or {}).get(
            "supervisor", {}).get("all_ready"), timeout=30)
        run.record_tree()
        run.wait_for("lines to be dropped", lambda: (status_doc() or {})["supervisor"]["log_lines_dropped"] > 1000)
        victim = next(s["pid"] for s in status_doc()["services"] if s["name"] == "victim")
        os.kill(victim, signal.SIGKILL)
        def stopping():
            doc = status_doc()
            return doc if doc and doc["supervisor"]["state"] == "stopping" else None

        doc = run.wait_for("the death to be acted on, stdout still stuck", stopping)
        assert doc["supervisor"]["stop_reason"] == "victim exited with code 137"
        tail = proc.stdout.read().decode(errors="replace")  # stdout moves again: to the end
        assert proc.wait(timeout=15) == 128 + signal.SIGKILL
        assert "log lines dropped: stdout did not keep up" in tail
        assert "exit 137: victim exited with code 137" in tail
    finally:
        run.stop()
        proc.stdout.close()


def test_a_flood_on_the_probe_port_is_bounded_and_logged_cleanly(tmp_path):
    import socket as socketlib
    with SupervisorRun(tmp_path, {"a": fake_service()}, health_max_clients=64) as run:
        run.wait_ready()
        held = []
        try:
            for _ in range(300):
                s = socketlib.create_connection(("127.0.0.1", run.health_port), timeout=5)
                held.append(s)
            assert run.status().returncode == 0  # the control socket is not the probe port
            assert http_get(run.health_port, "/healthz")[0] == 200  # the idle ones made room
            run.wait_for("the flood to be logged", lambda: "probe port:" in run.output())
        finally:
            for s in held:
                s.close()
        run.wait_for("the probe port to answer again", lambda: http_get(run.health_port, "/healthz")[0] == 200)
        doc = run.status_doc()
        assert doc["supervisor"]["probe_connections_refused"] > 0
        out = run.output()
        assert "Traceback" not in out
        assert all(line.split(" ", 1)[0] in ("onecard", "a") for line in out.splitlines() if line.strip()), out
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_the_long_running_supervisor_imports_no_pydantic_or_typer(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        p = psutil.Process(run.proc.pid)
        maps = " ".join(m.path for m in p.memory_maps())
        assert "pydantic_core" not in maps
        assert p.cmdline()[1] == "-c" and "supervisor.cli.supervise" in p.cmdline()[2]  # same pid, lean process

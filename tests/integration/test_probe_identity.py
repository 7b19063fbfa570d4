"""Whose answer a probe's answer is, against real processes and real sockets: a port taken
before the start, a foreign server answering on a service's port, a `command` service
probed over TCP with or without identity, an app service on its private unix socket."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time

import psutil

from tests.harness import ROOT, SupervisorRun, fake_service, free_port, http_get


class ForeignServer:
    """Another process's HTTP server on a port: answers every path 200, with no identity."""

    def __init__(self, port: int):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b'{"ready": true, "status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_taken_port_is_78_naming_the_port_and_its_holder_and_nothing_starts(tmp_path):
    services = {"a": fake_service(), "b": fake_service()}
    with ForeignServer(services["b"]["port"]):
        with SupervisorRun(tmp_path, services) as run:
            assert run.wait_exit(20) == 78
            out = run.output()
            port = services["b"]["port"]
            assert f"services.b.port: port {port} on 127.0.0.1 is taken by pid {os.getpid()} (" in out
            assert "started pid" not in out


def test_a_foreign_answer_on_the_port_is_never_taken_for_our_service(tmp_path):
    """The race after the port check: our command service does not listen yet, another
    process answers /readyz 200 on its port. The unit must not call it ready."""
    port = free_port()
    sleeper = {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "port": port}
    with SupervisorRun(tmp_path, {"quiet": sleeper}, startup_timeout_s=30.0) as run:
        run.wait_for("the service to start", lambda: "quiet: started pid" in run.output())
        with ForeignServer(port):
            def refused():
                error = run.service("quiet")["last_probe_error"] or ""
                return error if "another process" in error else None

            err = run.wait_for("a foreign answer to be refused", refused)
            assert f"/readyz on 127.0.0.1:{port} was answered by another process, not quiet" in err
            assert f"no process of the service's tree listens on port {port}" in err
            doc = run.status_doc()
            assert doc["services"][0]["state"] == "starting" and not doc["supervisor"]["all_ready"]
            assert http_get(run.health_port, "/readyz")[0] == 503
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def _uvicorn_command(port: int, **settings) -> dict:
    """fake_app run by uvicorn directly: a `command` service, probed over TCP."""
    code = (f"import json, sys, uvicorn; sys.path.insert(0, {str(ROOT)!r}); "
            "from tests.children.fake_app import create_app; "
            f"uvicorn.run(create_app(json.loads(sys.argv[1])), host='127.0.0.1', port={port}, log_level='warning')")
    return {"command": [sys.executable, "-c", code, json.dumps(settings)], "port": port}


def test_a_command_service_is_probed_over_tcp_with_its_token(tmp_path):
    port = free_port()
    with SupervisorRun(tmp_path, {"cmd": _uvicorn_command(port)}) as run:
        doc = run.wait_ready()
        assert doc["services"][0]["state"] == "ready"
        token = psutil.Process(run.child_pid("cmd")).environ()["ONECARD_INSTANCE_TOKEN"]
        assert "ONECARD_PROBE_SOCKET" not in psutil.Process(run.child_pid("cmd")).environ()
        assert json.loads(http_get(port, "/readyz")[1])["instance"] == token
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_a_command_service_without_identity_is_ours_when_it_holds_its_port(tmp_path):
    port = free_port()
    with SupervisorRun(tmp_path, {"plain": _uvicorn_command(port, anonymous=True)}) as run:
        run.wait_ready()
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_every_probe_answer_of_a_command_service_is_checked_not_only_the_first(tmp_path):
    """A wrapper whose server dies while the wrapper lives on, and another process takes the
    port: its answers are not the service's, so liveness fails (4)."""
    port, pidfile = free_port(), tmp_path / "server.pid"
    server = ROOT / "tests" / "children" / "daemon_server.py"
    svc = {"command": ["sh", "-c", f"{sys.executable} {server} {port} {pidfile}; sleep 600"], "port": port}
    with SupervisorRun(tmp_path, {"wrapped": svc}) as run:
        run.wait_ready()
        server = psutil.Process(int(pidfile.read_text()))
        server.kill()
        run.wait_for("the server to be gone", lambda: _dead(server))  # its socket closed with it
        with ForeignServer(port):
            assert run.wait_exit(20) == 4, run.output()
        out = run.output()
        assert f"/healthz on 127.0.0.1:{port} was answered by another process, not wrapped" in out
        assert "exit 4: wrapped failed 3 liveness probes in a row" in out
        run.assert_clean()


def test_app_services_are_probed_on_their_private_unix_socket(tmp_path):
    services = {"a": fake_service(tcp_probes_fail=True)}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()  # only the unix socket answers 200
        assert http_get(services["a"]["port"], "/readyz")[0] == 503
        sock = f"{run.socket}.d/probes/a.sock"
        assert os.path.exists(sock)
        assert stat.S_IMODE(os.stat(f"{run.socket}.d").st_mode) == 0o700
        time.sleep(1.2)  # liveness periods pass: still alive and ready
        assert run.service("a")["liveness_misses"] == 0 and run.status().returncode == 0
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0

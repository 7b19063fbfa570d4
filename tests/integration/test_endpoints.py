"""The supervisor's two doors cannot be held: idle clients on the control socket and on the
probe port, a crowd of status calls, and the probe port's answers to what is not a probe."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from supervisor.cli.status import Unreachable, fetch
from tests.harness import ROOT, SupervisorRun, fake_service, http_get


def _unix_idlers(path: str, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        out.append(s)
    return out


def test_idle_control_clients_never_lock_out_status_or_stop(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}, control_max_clients=32) as run:
        run.wait_ready()
        idlers = _unix_idlers(run.socket, 64)  # twice the slots, connected, silent
        try:
            assert run.status().returncode == 0
            more = _unix_idlers(run.socket, 64)  # a fresh wave while status is asked again
            idlers += more
            assert run.status().returncode == 0
            r = run.cli("stop", "--socket", run.socket, "--timeout", "30")
            assert r.returncode == 0, r.stderr
            assert run.wait_exit(15) == 0
        finally:
            for s in idlers:
                s.close()


def test_an_idle_control_client_is_closed_after_its_deadline(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}, control_idle_timeout_s=0.3) as run:
        run.wait_ready()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(4.0)  # long past the 0.3 s asked for (a timeout here fails the test)
        s.connect(run.socket)
        try:
            assert s.recv(100) == b""  # closed by the supervisor, unanswered
        finally:
            s.close()
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_a_crowd_of_status_calls_is_answered_every_one(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        start = threading.Barrier(500)

        def call(_):
            start.wait()
            try:
                return fetch(run.socket, timeout=20.0)["version"]
            except Unreachable as exc:
                return str(exc)

        with concurrent.futures.ThreadPoolExecutor(500) as pool:
            answers = list(pool.map(call, range(500)))
        assert answers.count(1) == 500, [a for a in answers if a != 1][:5]
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_idle_holders_on_the_probe_port_cause_no_probe_failure(tmp_path):
    """Three times the slots held by connections that send nothing, reopened as they are
    closed (the attack of a hostile neighbour): every probe is answered."""
    with SupervisorRun(tmp_path, {"a": fake_service()}, health_max_clients=48, health_idle_timeout_s=1.0) as run:
        run.wait_ready()
        with idle_holders(run.health_port, pause_s=0.05):
            time.sleep(1.0)
            codes = []
            for _ in range(40):
                codes.append(http_get(run.health_port, "/healthz", timeout=1.0)[0])
                time.sleep(0.05)
        assert codes == [200] * 40
        assert run.status_doc()["supervisor"]["probe_connections_refused"] > 0
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def test_a_probe_slow_to_send_after_its_connect_is_answered_while_holders_churn(tmp_path):
    """A probe's client descheduled between its connect and its send (a loaded machine) while
    150 idle holders reconnect as they are closed: it is answered, not closed as silent."""
    with SupervisorRun(tmp_path, {"a": fake_service()}, health_max_clients=48, health_idle_timeout_s=1.0) as run:
        run.wait_ready()
        answers = []
        with idle_holders(run.health_port, pause_s=0.01):
            time.sleep(1.0)
            for _ in range(8):
                with socket.create_connection(("127.0.0.1", run.health_port), timeout=5) as probe:
                    time.sleep(0.3)
                    try:
                        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        answers.append(probe.recv(64).split(b"\r\n", 1)[0])
                    except OSError as exc:
                        answers.append(repr(exc).encode())
        assert answers == [b"HTTP/1.1 200 OK"] * 8
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


@contextlib.contextmanager
def idle_holders(port: int, pause_s: float, threads: int = 3, each: int = 50) -> Iterator[None]:
    """`threads` x `each` connections to `port` that send nothing, each reopened when the
    server closes it (checked every `pause_s`); all closed on the way out, even on failure."""
    stop = threading.Event()

    def hold():
        held: list[socket.socket] = []
        try:
            while not stop.is_set():
                held = [s for s in held if not _closed(s)]
                while len(held) < each:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                time.sleep(pause_s)
        finally:
            for s in held:
                s.close()

    holders = [threading.Thread(target=hold) for _ in range(threads)]
    for t in holders:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in holders:
            t.join()


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def _raw(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


NOT_PROBES = [
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "method_not_allowed"),
    (b"DELETE /readyz HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
    (b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431, "headers_too_large"),
    (b"GET /healthz HTTP/1.1\r\nX-Endless: " + b"a" * 9000, 431, "headers_too_large"),  # no line end at all
    (b"NONSENSE\r\n\r\n", 400, "bad_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", 408, "request_timeout"),  # started, never finished
]


def test_the_probe_port_answers_what_is_not_a_probe_in_json(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}, health_idle_timeout_s=0.5) as run:
        run.wait_ready()
        for request_bytes, status, code in NOT_PROBES:
            got, headers, body = _raw(run.health_port, request_bytes)
            assert got == status, request_bytes[:40]
            assert headers["content-type"] == "application/json"
            assert body["error"]["code"] == code and body["error"]["message"]
            if status == 405:
                assert headers["allow"] == "GET, HEAD"
        assert http_get(run.health_port, "/healthz")[0] == 200
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_probe_port_listens_on_every_interface_of_both_families_by_default(tmp_path):
    with SupervisorRun(tmp_path, {"a": fake_service()}, health_host="") as run:
        run.wait_ready()
        assert http_get(run.health_port, "/healthz")[0] == 200
        if _has_ipv6_loopback():
            import http.client
            c = http.client.HTTPConnection("::1", run.health_port, timeout=10)
            try:
                c.request("GET", "/readyz")
                assert c.getresponse().status == 200
            finally:
                c.close()
        r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(run.config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert f"probes  http://*:{run.health_port}/healthz /readyz /metrics (every interface" in r.stdout
        run.signal(signal.SIGTERM)
        assert run.wait_exit(10) == 0

"""Run a real `onecard run` in a subprocess and clean up everything it started.

Every process the test starts is stopped by the test, even when it fails: the
supervisor runs in its own session, its whole tree is recorded while it runs, and
`stop()` kills whatever of it is left and reaps it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from tests.reaping import end_process_tree

ROOT = Path(__file__).resolve().parent.parent


def pythonpath() -> str:
    """The repository first, then the caller's own path (a machine whose packages are
    installed beside the interpreter, as wheels unpacked into a folder, keeps them)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


FAKE_APP = "tests.children.fake_app:create_app"


PORT_BLOCK = 500
# Where in its block a process starts: another test run on the same machine (a second
# checkout, say) walks the same blocks, and starting at the same port would collide.
_next_port = [os.getpid() * 7 % PORT_BLOCK]


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port that no other test worker can pick: each pytest-xdist worker takes ports
    from its own block below the kernel's ephemeral range (the kernel hands those to
    outgoing connections and bind(0), so nothing else in the suite races for them), and
    each port is checked bindable now. Ports never repeat within a worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = min(_ephemeral_low(), 32768) - 16 * PORT_BLOCK  # 16 blocks under the ephemeral range
    base = max(1024, low) + (index % 16) * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = base + _next_port[0] % PORT_BLOCK
        _next_port[0] += 1
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_BLOCK - 1}")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def write_config(path: Path, supervisor: dict, services: dict[str, dict], gpu: dict | None = None) -> Path:
    lines = ["[supervisor]"] + [f"{k} = {toml_value(v)}" for k, v in supervisor.items()]
    lines += ["[gpu]"] + [f"{k} = {toml_value(v)}" for k, v in (gpu or {}).items()]
    for name, svc in services.items():
        lines.append(f"\n[services.{name}]")
        settings = svc.get("settings", {})
        env = svc.get("env", {})
        for k, v in svc.items():
            if k not in ("settings", "env"):
                lines.append(f"{k} = {toml_value(v)}")
        lines.append(f"\n[services.{name}.env]")
        for k, v in env.items():
            lines.append(f"{k} = {toml_value(v)}")
        lines.append(f"\n[services.{name}.settings]")
        for k, v in settings.items():
            lines.append(f"{k} = {toml_value(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def fake_service(port: int | None = None, **settings: Any) -> dict:
    return {"app": FAKE_APP, "port": port or free_port(), "threads": 1,
            "env": {"PYTHONPATH": pythonpath()}, "settings": settings}


class SupervisorRun:
    def __init__(self, tmp: Path, services: dict[str, dict], extra_args: list[str] | None = None,
                 prefix: list[str] | None = None, env: dict[str, str] | None = None,
                 gpu: dict[str, Any] | None = None, **supervisor: Any):
        self.tmp = tmp
        self.socket = str(tmp / "ctl" / "c.sock")
        self.health_port = supervisor.pop("health_port", None) or free_port()
        sup = {"grace_s": 5.0, "startup_timeout_s": 30.0, "liveness_period_s": 0.5,
               "liveness_timeout_s": 1.0, "liveness_failures": 3, "health_host": "127.0.0.1",
               "health_port": self.health_port, "control_socket": self.socket, "sample_period_s": 0.5}
        sup.update(supervisor)
        self.services = services
        self.config = write_config(tmp / "onecard.toml", sup, services, gpu or {})
        self.log_path = tmp / "supervisor.log"
        self.extra_args = extra_args or []
        self.prefix = prefix or []
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.returncode: int | None = None

    def start(self, stdio: str = "log") -> SupervisorRun:
        """stdio: "log" (stdout and stderr to supervisor.log), "closed" (fds 1 and 2 closed, as
        `onecard run >&- 2>&-` leaves them), or a path to open for both (/dev/full)."""
        self._log = open(self.log_path, "wb")
        out = self._log if stdio in ("log", "closed") else open(stdio, "wb")

        def close_stdio() -> None:
            os.close(1)
            os.close(2)

        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "supervisor", "run", "--config", str(self.config), *self.extra_args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, "PYTHONPATH": pythonpath(), **self.env},
            preexec_fn=close_stdio if stdio == "closed" else None,
        )
        if out is not self._log:
            out.close()
        self.seen[self.proc.pid] = psutil.Process(self.proc.pid)
        return self

    def __enter__(self) -> SupervisorRun:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- observation ------------------------------------------------------------------
    def record_tree(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "supervisor", "status", "--socket", self.socket, *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=30)

    def cli(self, *args: str, env: dict[str, str] | None = None, cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": pythonpath(), **(env or {})})

    def status_doc(self) -> dict:
        r = self.status("--json")
        assert r.returncode in (0, 1), r.stderr
        return json.loads(r.stdout)

    def child_pid(self, name: str) -> int:
        return next(s["pid"] for s in self.status_doc()["services"] if s["name"] == name)

    def wait_ready(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited {self.proc.returncode}:\n{self.output()}")
            r = self.status("--json")
            if r.returncode == 0:
                self.record_tree()
                return json.loads(r.stdout)
            last = r
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout} s: {last and last.stdout}\n{self.output()}")

    def wait_exit(self, timeout: float) -> int:
        self.returncode = self.proc.wait(timeout=timeout)
        return self.returncode

    def wait_for(self, what: str, predicate, timeout: float = 15.0, period: float = 0.1):
        """Poll until predicate() is truthy and return it; fail naming `what` otherwise."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited {self.proc.returncode} while waiting for {what}:\n"
                                     f"{self.output()}")
            last = predicate()
            if last:
                return last
            time.sleep(period)
        raise AssertionError(f"{what}: not reached in {timeout} s (last: {last!r})\n{self.output()[-3000:]}")

    def service(self, name: str) -> dict:
        return next(s for s in self.status_doc()["services"] if s["name"] == name)

    def signal(self, sig: int) -> None:
        self.record_tree()
        self.proc.send_signal(sig)

    # ---- cleanup ----------------------------------------------------------------------
    def leftovers(self) -> list[psutil.Process]:
        """Processes of this run that still exist (orphans), zombies included."""
        out = []
        for pid, p in self.seen.items():
            if pid == self.proc.pid:
                continue
            if p.is_running():  # true for zombies too: a zombie is a leftover
                out.append(p)
        return out

    def assert_clean(self) -> None:
        """Nothing this run started is left behind, zombies included."""
        left = self.wait_no_leftovers()
        assert not left, f"left behind: {[(p.pid, p.status()) for p in left]}"

    def wait_no_leftovers(self, timeout: float = 3.0) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = self.leftovers()
            if not left:
                return []
            time.sleep(0.05)
        return self.leftovers()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.record_tree()
        end_process_tree(self.proc, self.seen.values(), timeout=10, others_timeout=2)
        remove_unit_cgroups(self.socket)
        self._log.close()


def remove_unit_cgroups(control_socket: str) -> None:
    """The empty cgroups a run killed with its sentinel (SIGKILL of the whole tree) leaves: a
    next run on the same socket would remove them; tests use a new socket each time."""
    from supervisor.system.containment import hierarchy_base, remove_tree, unit_key  # the checkout's, as the run's
    for kind in ("cgroup2", "cgroup1"):
        found = hierarchy_base(kind)
        if found is not None:
            remove_tree(found[0] / f"onecard.{unit_key(control_socket)}")


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()

"""Run one service as the supervisor would (`python -m services.runtime.serve`), on a real port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from onecard.testing import wait_until_ready
from tests.harness import ROOT, free_port
from tests.reaping import end_process_tree


class ServiceProcess:
    def __init__(self, app: str, settings: dict[str, Any], tmp: Path, threads: int = 1, env: dict | None = None,
                 soft_nofile: int | None = None, wrap=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"service-{self.port}.log"
        import shutil
        import tempfile
        import weakref
        self._sock_dir = tempfile.mkdtemp(prefix="oc-")  # unix socket paths must stay under 108 bytes
        weakref.finalize(self, shutil.rmtree, self._sock_dir, True)
        self.probe_socket = os.path.join(self._sock_dir, "probe.sock")
        self.instance = f"test-{self.port}"
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        self.env = {**os.environ, "PYTHONPATH": path,
                    "ONECARD_SERVICE_APP": app,
                    "ONECARD_PROBE_SOCKET": self.probe_socket, "ONECARD_INSTANCE_TOKEN": self.instance,
                    "ONECARD_SERVICE_NAME": "svc", "ONECARD_SERVICE_HOST": "127.0.0.1",
                    "ONECARD_SERVICE_PORT": str(self.port), "ONECARD_SERVICE_THREADS": str(threads),
                    "ONECARD_SERVICE_CONFIG": json.dumps(settings), "OMP_NUM_THREADS": str(threads),
                    **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.soft_nofile = soft_nofile
        self.wrap = wrap  # argv -> argv: starts the service through something (a cgroup, a namespace)

    def __enter__(self) -> ServiceProcess:
        self._log = open(self.log_path, "wb")
        def lower_nofile() -> None:
            if self.soft_nofile is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE,
                                   (self.soft_nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        argv = [sys.executable, "-m", "services.runtime.serve"]
        self.proc = subprocess.Popen(self.wrap(argv) if self.wrap else argv, cwd=ROOT, env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=lower_nofile)
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)  # a service that failed to start is still stopped
            raise
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_until_ready(self.proc, self.url, self.instance, timeout, self.output)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        end_process_tree(self.proc, timeout=10, others_timeout=5)
        self._log.close()


def probe(path: str, route: str = "/healthz", timeout: float = 2.0) -> tuple[int, dict]:
    """GET a probe over a service's unix probe socket."""
    import socket as _socket
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(f"GET {route} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body) if body.startswith(b"{") else {"text": body.decode()}

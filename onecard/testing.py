"""Helpers for a service's own tests: start it as the supervisor would, send it pictures,
check the error envelope.

    from onecard.testing import ServiceProcess, assert_error, picture

    def test_reads_text(tmp_path):
        with ServiceProcess("ocr_service.app:create_app", {"lang": "en"}) as svc:
            r = svc.post_image("/api/v1/ocr", picture(64, 64), form="multipart")
            assert r.status_code == 200
            assert_error(svc.post("/api/v1/ocr", json={}), 422, "invalid_parameter")

``ServiceProcess`` runs ``python -m services.runtime.serve`` with the environment the
supervisor gives a service (its settings as JSON, a port, a probe socket, an instance
token, the thread plan), waits until that very process answers /readyz, and stops it (and
anything it started) on exit, also when the test fails. Requests go through httpx.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MARK = "ONECARD_TESTING_SERVICE"  # in the environment of a ServiceProcess and what it starts

__all__ = ["ServiceProcess", "assert_error", "free_port", "picture"]


def free_port() -> int:
    """A port free now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def picture(width: int = 64, height: int = 64, format: str = "png", color: tuple[int, int, int] = (200, 120, 40),
            ) -> bytes:
    """An encoded picture of one color (format: png, jpeg, webp, bmp)."""
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format={"jpg": "JPEG"}.get(format, format.upper()))
    return buf.getvalue()


def assert_error(response: httpx.Response, status: int, code: str | None = None, in_message: str = "") -> dict:
    """The answer is onecard's error envelope with this status (and code, and text in its
    message); the error object is returned."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:500]}"
    doc = response.json()
    assert set(doc) >= {"error"} and isinstance(doc["error"], dict), f"not the error envelope: {doc}"
    error = doc["error"]
    assert isinstance(error.get("code"), str) and isinstance(error.get("message"), str), f"malformed: {error}"
    if code is not None:
        assert error["code"] == code, f"expected code {code!r}, got {error['code']!r}: {error['message']}"
    assert in_message in error["message"], f"{in_message!r} not in {error['message']!r}"
    return error


def wait_until_ready(proc: subprocess.Popen, url: str, instance: str, timeout_s: float,
                     output: Callable[[], str]) -> None:
    """Until ``url``/readyz answers 200 for this instance (not whatever else answers on the
    port: another run's service); an AssertionError with the service's output when it exits
    or is not ready within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the service exited {proc.returncode}:\n{output()}")
        try:
            r = httpx.get(url + "/readyz", timeout=2)
            if r.status_code == 200 and r.headers.get("x-onecard-instance") == instance:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the service was not ready within {timeout_s:g} s:\n{output()}")


class ServiceProcess:
    """One service process on a free port, as the supervisor starts it."""

    def __init__(self, app: str, settings: dict[str, Any] | None = None, *, name: str = "svc",
                 pythonpath: list[str | Path] = (), env: dict[str, str] | None = None, threads: int = 1,
                 ready_timeout_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.instance = f"test-{uuid.uuid4().hex[:12]}"
        self._dir = tempfile.mkdtemp(prefix="oc-")  # unix socket paths must stay under 108 bytes
        self.probe_socket = os.path.join(self._dir, "probe.sock")
        self.log_path = Path(self._dir) / "service.log"
        path = [str(p) for p in pythonpath] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env = {**os.environ, "ONECARD_SERVICE_APP": app, "ONECARD_SERVICE_NAME": name,
                    "ONECARD_SERVICE_HOST": "127.0.0.1", "ONECARD_SERVICE_PORT": str(self.port),
                    "ONECARD_SERVICE_CONFIG": json.dumps(settings or {}), "ONECARD_SERVICE_THREADS": str(threads),
                    "OMP_NUM_THREADS": str(threads), "ONECARD_PROBE_SOCKET": self.probe_socket,
                    "ONECARD_INSTANCE_TOKEN": self.instance, "PYTHONUNBUFFERED": "1", **(env or {}),
                    MARK: self.instance}
        if path:
            self.env["PYTHONPATH"] = os.pathsep.join(path)
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def __enter__(self) -> ServiceProcess:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.serve"], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_ready(self) -> None:
        wait_until_ready(self.proc, self.url, self.instance, self.ready_timeout_s, self.output)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __exit__(self, *exc: Any) -> None:
        self.client.close()
        left = self._started_processes()
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the group is its tree
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
            except ProcessLookupError:
                pass
            self.proc.wait()
        for process in left:  # those that left its session (setsid, a daemon's double fork)
            try:
                process.kill()
            except Exception:  # noqa: BLE001 - gone already, or not ours to kill
                pass
        if hasattr(self, "_log"):
            self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _started_processes(self) -> list:
        """What the service started, wherever it went: its descendants now, and any process
        carrying its mark in the environment (re-parented away from it, in another session)."""
        import psutil  # (only here: `import onecard` stays cheap)
        found: dict[int, Any] = {}
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True) if self.proc is not None else ():
                found[child.pid] = child
        except psutil.Error:
            pass
        for process in psutil.process_iter():
            if process.pid in found or (self.proc is not None and process.pid == self.proc.pid):
                continue
            try:
                if process.environ().get(MARK) == self.instance:
                    found[process.pid] = process
            except psutil.Error:
                continue
        return list(found.values())

    # ---- requests ----------------------------------------------------------------------------
    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, **kwargs)

    def post_image(self, path: str, data: bytes, *, form: str = "raw", params: dict[str, Any] | None = None,
                   field: str = "image", headers: dict[str, str] | None = None) -> httpx.Response:
        """Send a picture as a raw body (parameters in the query string), a multipart form
        (parameters as text fields) or JSON with base64 (parameters as typed fields)."""
        params = params or {}
        if form == "raw":
            mime = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
            return self.client.post(path, content=data, params=params,
                                    headers={"content-type": mime, **(headers or {})})
        if form == "multipart":
            return self.client.post(path, files={field: ("picture", data)},
                                    data={k: str(v) for k, v in params.items()}, headers=headers)
        if form == "json":
            return self.client.post(path, json={field: base64.b64encode(data).decode(), **params}, headers=headers)
        raise ValueError("form: 'raw', 'multipart' or 'json'")

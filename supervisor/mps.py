"""The NVIDIA MPS control daemon's lifecycle, with private pipe and log directories.

Started before any service, so that every service's CUDA context goes through it;
stopped (`quit` on its control pipe) after the last service is gone, on every exit
path. A daemon left by an earlier crash still holds the pipe directory: it is told to
quit first, and its leftovers are removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

BINARY = "nvidia-cuda-mps-control"


class MpsError(Exception):
    pass


class MpsDaemon:
    def __init__(self, base_dir: str, start_timeout_s: float = 10.0,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                 log: Callable[[str], None] = lambda msg: None):
        self.base = Path(base_dir)
        self.pipe_dir = self.base / "pipe"
        self.log_dir = self.base / "log"
        self.start_timeout_s = start_timeout_s
        self._run = run
        self._log = log
        self.started = False

    @staticmethod
    def binary() -> str | None:
        return shutil.which(BINARY)

    def problem(self) -> str | None:
        """What stops MPS from starting, found without starting it (for `onecard check`)."""
        if self.binary() is None:
            return f"[gpu] mps = true, but {BINARY} is not on PATH ({os.environ.get('PATH', '')})"
        return None

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _call(self, args: list[str], stdin: str | None = None, timeout: float = 10.0) -> subprocess.CompletedProcess:
        exe = self.binary()
        if exe is None:
            raise MpsError(self.problem())
        try:
            return self._run([exe, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **self.env()})
        except subprocess.TimeoutExpired:
            raise MpsError(f"{BINARY} {' '.join(args)} did not return within {timeout:g} s") from None

    def _control_pipe(self) -> Path:
        return self.pipe_dir / "control"

    def start(self) -> None:
        problem = self.problem()
        if problem:
            raise MpsError(problem)
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._control_pipe().exists():
            self._log(f"MPS: a daemon from an earlier run holds {self.pipe_dir}; asking it to quit")
            try:
                self._call([], stdin="quit\n", timeout=5)
            except MpsError as exc:
                self._log(f"MPS: the old daemon did not answer ({exc}); removing its files")
            self._wait_gone(5.0)
            for leftover in self.pipe_dir.iterdir():
                leftover.unlink(missing_ok=True)
        result = self._call(["-d"])
        if result.returncode != 0:
            raise MpsError(f"{BINARY} -d failed with code {result.returncode}: "
                           f"{(result.stderr or result.stdout).strip()[:500]}")
        deadline = time.monotonic() + self.start_timeout_s
        while not self._control_pipe().exists():
            if time.monotonic() > deadline:
                raise MpsError(f"MPS daemon did not create {self._control_pipe()} within "
                               f"{self.start_timeout_s:g} s; see {self.log_dir}/control.log")
            time.sleep(0.05)
        self.started = True
        self._log(f"MPS: control daemon started (pipe {self.pipe_dir}, log {self.log_dir})")

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._control_pipe().exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._control_pipe().exists()

    def stop(self) -> None:
        if not self.started:
            return
        self.started = False
        try:
            result = self._call([], stdin="quit\n", timeout=10)
            if result.returncode != 0:
                self._log(f"MPS: quit answered code {result.returncode}: {result.stderr.strip()[:300]}")
        except MpsError as exc:
            self._log(f"MPS: quit failed: {exc}")
            return
        if self._wait_gone(5.0):
            self._log("MPS: control daemon stopped")
        else:
            self._log(f"MPS: {self._control_pipe()} still exists after quit")

"""Every system call the supervisor makes, behind one thin class that tests can replace.

The policy never touches `os` for processes or signals directly; a fake with the same
methods replays scripted histories in unit tests, and this real one is exercised by the
integration tests with real processes and real signals. Time is the clock's (clock.py).
The containment (containment.py) and the sentinel (sentinel.py) are reached through it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from supervisor.system import containment, proctable, signal_mask
from supervisor.system.containment import Containment, Leftover, Marker
from supervisor.system.sentinel import bootstrap

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


@dataclass(frozen=True)
class Spawned:
    pid: int
    output_fd: int  # read end of the child's merged stdout+stderr


def exit_code_of(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128+N for signal N."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


class OsLayer:
    def getpid(self) -> int:
        return os.getpid()

    def become_subreaper(self) -> bool:
        """Orphans of our children re-parent to us (as they would to PID 1), so we reap them."""
        if _prctl is None:
            return False
        return _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0

    def raise_open_files_limit(self) -> None:
        """Soft RLIMIT_NOFILE up to the hard limit: a flood on the probe port meets our own
        connection limit first, not EMFILE."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                pass

    # ---- signals: held from the first instruction until the handlers exist (cli/early.py) ----
    def release_signals(self, sigs: tuple[int, ...]) -> None:
        """Unblock: what arrived while they were held is delivered now, to the handlers."""
        signal_mask.unblock(sigs)

    def hold_signals(self, sigs: tuple[int, ...]) -> None:
        """Block for good (until exit): a late signal waits instead of replacing the exit
        code the supervisor chose or cutting its last lines."""
        signal_mask.block(sigs)

    def spawn(self, argv: list[str], env: dict[str, str], stdin_data: bytes | None = None,
              join: str | None = None, pass_fds: tuple[int, ...] = (), own_session: bool = False,
              death_signal: bool = True) -> Spawned:
        """A fresh program (exec, never a bare fork) in its own process group.

        The child gets SIGKILL when the supervisor dies, however it dies, so that a
        SIGKILLed supervisor leaves nothing behind. `stdin_data` (small: one pipe buffer)
        is what it reads on stdin, else /dev/null. `join` is the cgroup.procs file the
        child writes itself into before exec, so that nothing it starts escapes the cgroup.
        """
        stdin: int = subprocess.DEVNULL
        in_write = None
        if stdin_data is not None:
            stdin, in_write = os.pipe()
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        join_fd = os.open(join, os.O_WRONLY | os.O_CLOEXEC) if join else None

        def _in_child() -> None:
            # The supervisor holds its stop signals blocked until its handlers exist and
            # again at its end; a service starts with none blocked.
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            if join_fd is not None:
                os.write(join_fd, b"0")  # "0": the writing process itself
            if _prctl is not None and death_signal:
                _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The supervisor may have died between fork and prctl: then nobody will
            # send the death signal, so act on it now.
            if death_signal and os.getppid() != parent:
                os._exit(1)

        try:
            proc = subprocess.Popen(
                argv, env=env, stdin=stdin, stdout=write_fd, stderr=write_fd,
                process_group=None if own_session else 0, start_new_session=own_session,
                preexec_fn=_in_child, close_fds=True, pass_fds=pass_fds,
            )
        except BaseException:
            os.close(read_fd)
            if in_write is not None:
                os.close(in_write)
            raise
        finally:
            os.close(write_fd)
            if join_fd is not None:
                os.close(join_fd)
            if in_write is not None:
                os.close(stdin)
        if in_write is not None:
            try:
                os.write(in_write, stdin_data)
            except OSError:
                pass
            os.close(in_write)
        # We reap with waitpid(-1) ourselves; keep Popen from ever polling this pid.
        proc.returncode = 0
        os.set_blocking(read_fd, False)
        return Spawned(proc.pid, read_fd)

    def kill_group(self, pgid: int, sig: int) -> bool:
        """Signal a whole process group; False when nothing of it is left."""
        try:
            os.killpg(pgid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False

    def kill(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def reap(self) -> list[tuple[int, int]]:
        """Every child that has changed state: (pid, wait status); never blocks."""
        out = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if pid == 0:
                break
            out.append((pid, status))
        return out

    def close(self, fd: int) -> None:
        try:
            os.close(fd)
        except OSError:
            pass

    def write(self, fd: int, data: bytes) -> None:
        try:
            os.write(fd, data)
        except OSError:
            pass

    # ---- containment (containment.py; called in worker threads) ----------------------------
    def containment(self, marker: Marker, names: list[str], mode: str) -> Containment:
        return containment.create(marker, names, mode)

    def leftovers(self, marker: Marker) -> tuple[list[Leftover], list]:
        return containment.leftovers(marker)

    def end_leftovers(self, marker: Marker, found: list[Leftover], dirs: list) -> set[int]:
        return containment.end_leftovers(marker, found, dirs)

    def own_children(self) -> set[int]:
        """Our live direct children: services, helpers and orphans we adopted."""
        return {p for p in proctable.children_of(os.getpid()) if proctable.alive(p)}

    def start_sentinel(self, spec: dict) -> tuple[int, int]:
        """(pid, the write end of its pipe); see sentinel.py."""
        read_fd, write_fd = os.pipe()
        os.set_inheritable(read_fd, True)
        root = str(Path(__file__).resolve().parents[2])  # the checkout that holds the supervisor package
        try:
            spawned = self.spawn([sys.executable, "-S", "-E", "-c", bootstrap(root), str(read_fd), json.dumps(spec)],
                                 {}, pass_fds=(read_fd,), own_session=True, death_signal=False)
        finally:
            os.close(read_fd)
        os.close(spawned.output_fd)
        return spawned.pid, write_fd

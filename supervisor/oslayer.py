"""Every system call the supervisor makes, behind one thin class that tests can replace.

The policy never touches `os` for processes or signals directly; a fake with the same
methods replays scripted histories in unit tests, and this real one is exercised by the
integration tests with real processes and real signals. Time is the clock's (clock.py).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import resource
import subprocess
from dataclasses import dataclass

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

    def spawn(self, argv: list[str], env: dict[str, str], stdin_data: bytes | None = None) -> Spawned:
        """A fresh program (exec, never a bare fork) in its own process group.

        The child gets SIGKILL when the supervisor dies, however it dies, so that a
        SIGKILLed supervisor leaves nothing behind. `stdin_data` (small: one pipe buffer)
        is what it reads on stdin, else /dev/null.
        """
        stdin: int = subprocess.DEVNULL
        in_write = None
        if stdin_data is not None:
            stdin, in_write = os.pipe()
        read_fd, write_fd = os.pipe()
        parent = os.getpid()

        def _in_child() -> None:
            if _prctl is not None:
                _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The supervisor may have died between fork and prctl: then nobody will
            # send the death signal, so act on it now.
            if os.getppid() != parent:
                os._exit(1)

        try:
            proc = subprocess.Popen(
                argv, env=env, stdin=stdin, stdout=write_fd, stderr=write_fd,
                process_group=0, preexec_fn=_in_child, close_fds=True,
            )
        except BaseException:
            os.close(read_fd)
            if in_write is not None:
                os.close(in_write)
            raise
        finally:
            os.close(write_fd)
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

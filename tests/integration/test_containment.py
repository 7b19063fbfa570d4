"""Nothing a service starts outlives the unit: real servers that leave their session, real
cgroups (v2, v1) and the process-tree fallback, a real SIGKILL of the supervisor."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import ROOT, SupervisorRun, fake_service, free_port, http_get

SERVER = str(ROOT / "tests" / "children" / "daemon_server.py")


def _usable(mode: str) -> bool:
    from supervisor.system.containment import Marker, create
    c = create(Marker("probe" + secrets.token_hex(4), "x"), ["s"], mode)
    c.release()
    return c.kind == mode


MODES = [pytest.param(m, marks=pytest.mark.skipif(not _usable(m), reason=f"no {m} containment here"))
         for m in ("cgroup2", "cgroup1", "process")]


def wrapper(port: int, pidfile: Path, *flags: str, then: str = "wait") -> dict:
    """A `sh start.sh`-like service: the server runs in a child that called setsid()."""
    script = f"{sys.executable} {SERVER} {port} {pidfile} {' '.join(flags)} & {then}"
    return {"command": ["sh", "-c", script], "port": port}


def server_pid(run: SupervisorRun, pidfile: Path) -> int:
    return int(run.wait_for("the server's pid file", lambda: pidfile.exists() and pidfile.read_text()))


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_ends_a_server_that_left_its_session_and_exits_0(tmp_path, mode):
    port, pidfile = free_port(), tmp_path / "server.pid"
    with SupervisorRun(tmp_path, {"wrapped": wrapper(port, pidfile)}, containment=mode) as run:
        run.wait_ready()
        pid = server_pid(run, pidfile)
        try:
            assert os.getsid(pid) == pid != os.getsid(run.child_pid("wrapped"))  # out of the wrapper's session
            assert f"containment: {mode}" in run.output()
            run.signal(signal.SIGTERM)
            assert run.wait_exit(15) == 0, run.output()
            assert gone(pid, timeout=0.5), "the unit exited while the server it started was alive"
            assert port_free(port)
        finally:
            kill_quietly(pid)


@pytest.mark.parametrize("mode", MODES)
def test_a_server_that_ignores_sigterm_is_killed_at_grace_and_the_stop_says_work_was_lost(tmp_path, mode):
    port, pidfile = free_port(), tmp_path / "server.pid"
    with SupervisorRun(tmp_path, {"wrapped": wrapper(port, pidfile, "ignore-term")}, containment=mode,
                       grace_s=1.5) as run:
        run.wait_ready()
        pid = server_pid(run, pidfile)
        try:
            run.signal(signal.SIGTERM)
            assert run.wait_exit(15) == 75, run.output()
            assert gone(pid, timeout=0.5)
            out = run.output()
            assert "wrapped: its main process exited; 1 process(es) it started are still running" in out
            assert f"wrapped: 1 process(es) it started still running after SIGTERM (pids {pid}); SIGKILL" in out
            assert "were SIGKILLed after grace_s" in out
        finally:
            kill_quietly(pid)


@pytest.mark.parametrize("mode", MODES)
def test_a_stopped_process_left_behind_is_woken_to_act_on_its_sigterm(tmp_path, mode):
    """The service's main exits, leaving a server it started that is stopped (SIGSTOP): the
    SIGTERM it is sent is held until it runs again. Without the SIGCONT that follows it, the
    server was SIGKILLed at grace and never ran its own stop."""
    port, pidfile = free_port(), tmp_path / "server.pid"
    svc = wrapper(port, pidfile, "note-term",
                  then=f"while [ ! -s {pidfile} ]; do sleep 0.05; done; kill -STOP $(cat {pidfile}); exit 3")
    with SupervisorRun(tmp_path, {"leaver": svc}, containment=mode, grace_s=3.0) as run:
        assert run.wait_exit(20) == 3, run.output()
        pid = int(pidfile.read_text())
        try:
            assert gone(pid, timeout=0.5)
            out = run.output()
            assert (tmp_path / "server.pid.term").exists(), f"the stopped server never ran its SIGTERM handler\n{out}"
            assert "still running after SIGTERM" not in out, out
        finally:
            kill_quietly(pid)


@pytest.mark.parametrize("mode", MODES)
def test_a_service_that_dies_leaving_a_detached_daemon_takes_it_down_with_the_unit(tmp_path, mode):
    """The daemon double-forked: re-parented to the supervisor (the subreaper), in no
    service's process tree any more."""
    port, pidfile = free_port(), tmp_path / "server.pid"
    svc = wrapper(port, pidfile, "detach", then=f"while [ ! -s {pidfile} ]; do sleep 0.05; done; exit 3")
    with SupervisorRun(tmp_path, {"leaver": svc}, containment=mode) as run:
        assert run.wait_exit(20) == 3, run.output()
        pid = int(pidfile.read_text())
        try:
            assert gone(pid, timeout=0.5), "the unit exited while the daemon its service started was alive"
            assert port_free(port)
            # ended as part of its service's stop, not found by the last sweep
            assert "process(es) of the unit still running after its services exited" not in run.output()
        finally:
            kill_quietly(pid)


@pytest.mark.parametrize("mode", [m for m in MODES if m.values[0] == "process"])
def test_an_adopted_orphan_that_dropped_the_marker_is_ended_before_the_unit_exits(tmp_path, mode):
    """A daemon that detached and cleared its environment: in process mode nothing names its
    service any more, but it was re-parented to the supervisor (the subreaper). (A cgroup
    holds it whatever its environment.)"""
    port, pidfile = free_port(), tmp_path / "server.pid"
    svc = wrapper(port, pidfile, "detach", "bare-env", then=f"while [ ! -s {pidfile} ]; do sleep 0.05; done; exit 3")
    with SupervisorRun(tmp_path, {"leaver": svc}, containment=mode) as run:
        assert run.wait_exit(20) == 3, run.output()
        pid = int(pidfile.read_text())
        try:
            assert gone(pid, timeout=0.5), "the unit exited while a process it adopted was alive"
            assert port_free(port)
        finally:
            kill_quietly(pid)


def test_a_sentinel_that_does_not_end_when_told_is_killed_before_the_unit_exits(tmp_path):
    """The sentinel stopped (SIGSTOP) when the unit stops: told it is done, it cannot go. The
    unit exited 0 with it still alive; a unit never exits 0 while a process it started lives."""
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        run.record_tree()
        sentinel = next(p for p in run.seen.values() if "sentinel" in " ".join(p.cmdline()))
        os.kill(sentinel.pid, signal.SIGSTOP)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(20) == 0, run.output()
        assert f"the sentinel (pid {sentinel.pid}) did not end when told; SIGKILL" in run.output()
        assert gone(sentinel.pid)
        run.assert_clean()


@pytest.mark.parametrize("mode", MODES)
def test_a_sigkilled_supervisor_leaves_no_server_behind(tmp_path, mode):
    port, pidfile = free_port(), tmp_path / "server.pid"
    services = {"wrapped": wrapper(port, pidfile)}
    with SupervisorRun(tmp_path, services, containment=mode) as run:
        run.wait_ready()
        pid = server_pid(run, pidfile)
        try:
            run.signal(signal.SIGKILL)
            run.wait_exit(5)
            assert gone(pid), "the server outlived its SIGKILLed supervisor"
            assert run.wait_no_leftovers(5) == []  # the sentinel too, once its work is done
            assert port_free(port)
        finally:
            kill_quietly(pid)


@pytest.mark.parametrize("mode", MODES)
def test_the_next_start_ends_what_a_dead_unit_left_and_says_so(tmp_path, mode):
    """Supervisor and sentinel SIGKILLed at once: nothing cleans up; the next start on the
    same control socket finds the server by its cgroup or its environment, ends it, runs."""
    port, pidfile = free_port(), tmp_path / "server.pid"
    services = {"wrapped": wrapper(port, pidfile)}
    first = SupervisorRun(tmp_path, services, containment=mode)
    with first:
        first.wait_ready()
        pid = server_pid(first, pidfile)
        try:
            first.record_tree()
            others = [p.pid for p in first.seen.values() if p.pid != pid]  # the supervisor, its sentinel, the wrapper
            for sig in (signal.SIGSTOP, signal.SIGKILL):  # all frozen first: none sees another die and cleans up
                for other in others:
                    kill_quietly(other, sig)
            first.wait_exit(5)
            time.sleep(0.5)
            assert psutil.Process(pid).is_running() and not port_free(port)
            pidfile.unlink()
            with SupervisorRun(tmp_path, services, containment=mode) as second:
                second.wait_ready()
                out = second.output()
                assert "an earlier run of this unit (its supervisor gone) left 1 process(es): " \
                       f"pid {pid} ({sys.executable} {SERVER} {port}" in out
                assert "ending them (SIGKILL)" in out
                assert gone(pid, timeout=1.0)
                assert http_get(port, "/readyz")[0] == 200  # the new run's server
                second.signal(signal.SIGTERM)
                assert second.wait_exit(15) == 0
        finally:
            kill_quietly(pid)


def test_a_second_start_never_ends_the_processes_of_a_supervisor_that_is_alive(tmp_path):
    """Its control socket deleted (it makes it again only at its next sampling), a live unit
    is not 'what an earlier run left': the second start leaves it alone and stops at the
    taken port (78)."""
    port, pidfile = free_port(), tmp_path / "server.pid"
    services = {"wrapped": wrapper(port, pidfile)}
    with SupervisorRun(tmp_path, services, sample_period_s=60.0) as first:
        first.wait_ready()
        pid = server_pid(first, pidfile)
        os.unlink(first.socket)
        with SupervisorRun(tmp_path, services) as second:
            assert second.wait_exit(20) == 78, second.output()
            assert "left" not in second.output()
        assert psutil.Process(pid).is_running() and first.proc.poll() is None
        assert http_get(port, "/readyz")[0] == 200

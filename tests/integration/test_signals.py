"""No signal is lost and none changes the exit code: real signals at the first milliseconds
(as PID 1 and not), storms during a stop, Ctrl-C held down, closed standard streams, and a
supervisor frozen with SIGSTOP."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.harness import ROOT, SupervisorRun, fake_service, http_get

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _can_unshare_pid() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return r.returncode == 0


PID1 = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
AS = [pytest.param(False, id="plain"),
      pytest.param(True, id="pid1", marks=pytest.mark.skipif(not _can_unshare_pid(), reason="needs unshare --pid"))]


def _supervisor_process(run: SupervisorRun, pid1: bool, timeout: float = 10.0) -> psutil.Process:
    """The supervisor's own process (inside the namespace it is PID 1, here a host pid)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not pid1:
                p = psutil.Process(run.proc.pid)
            else:
                kids = psutil.Process(run.proc.pid).children()
                if not kids:
                    continue
                p = kids[0]
            cmd = p.cmdline()
            if cmd and cmd[0] == sys.executable and "supervisor" in " ".join(cmd):  # exec'd: not unshare
                return p
        except psutil.Error:
            pass
        time.sleep(0.001)
    raise AssertionError(f"no supervisor process within {timeout} s")


def _sigterm_blocked(pid: int) -> bool:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigBlk:"):
                return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    except OSError:
        pass
    return False


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return False


@pytest.mark.parametrize("pid1", AS)
@pytest.mark.parametrize("phase", ["command line", "lean supervisor"])
def test_a_sigterm_in_the_first_milliseconds_waits_for_the_handlers_and_drains(tmp_path, pid1, phase):
    """Sent while `onecard run` validates its config, or right after it exec'd the lean
    supervisor: never dropped (PID 1 has no default action), never a kill (other PIDs)."""
    run = SupervisorRun(tmp_path, {"a": fake_service(startup_delay_s=0.5)}, prefix=PID1 if pid1 else None)
    with run:
        p = _supervisor_process(run, pid1)
        if phase == "lean supervisor":
            _wait(lambda: "supervisor.cli.supervise" in " ".join(p.cmdline()), 10.0)
        else:
            _wait(lambda: _sigterm_blocked(p.pid), 2.0)  # an unprotected start gets it all the same
        p.send_signal(signal.SIGTERM)
        assert run.wait_exit(20) == 0, run.output()
        out = run.output()
        assert "SIGTERM received" in out and "exit 0: SIGTERM received" in out
        assert "all services ready" not in out  # it stopped before the services were ready


@pytest.mark.parametrize("crash", [False, True])
def test_a_signal_storm_during_a_stop_never_replaces_the_exit_code(tmp_path, crash):
    services = {"a": fake_service(), "b": fake_service()}
    with SupervisorRun(tmp_path, services) as run:
        run.wait_ready()
        run.record_tree()
        stop = threading.Event()

        def storm():
            while not stop.is_set() and run.proc.poll() is None:
                try:
                    os.kill(run.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    return
                time.sleep(0.0005)

        if crash:  # the crash is the first cause; the storm comes after it
            http_get(services["b"]["port"], "/crash?code=7")
            run.wait_for("the crash to stop the unit", lambda: "b: exited with code 7; stopping" in run.output())
        stormer = threading.Thread(target=storm)
        stormer.start()
        try:
            code = run.wait_exit(20)
        finally:
            stop.set()
            stormer.join()
        out = run.output()
        assert code == (7 if crash else 0), out
        assert ("exit 7: b exited with code 7" if crash else "exit 0: SIGTERM received") in out
        assert not os.path.exists(run.socket)  # removed on this path too
        assert run.wait_no_leftovers() == []


def test_ctrl_c_held_down_from_the_start_prints_no_traceback(tmp_path):
    """SIGINT every 2 ms from the moment the command holds its signals to its exit: a
    requested stop, then the second SIGINT forces it (130); never a KeyboardInterrupt."""
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        p = _supervisor_process(run, False)
        assert _wait(lambda: _sigterm_blocked(p.pid), 10.0)

        def held():
            while run.proc.poll() is None:
                try:
                    os.kill(run.proc.pid, signal.SIGINT)
                except ProcessLookupError:
                    return
                time.sleep(0.002)

        presser = threading.Thread(target=held)
        presser.start()
        try:
            code = run.wait_exit(20)
        finally:
            presser.join()
        out = run.output()
        assert code in (0, 130), out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out
        assert f"exit {code}:" in out
        assert not os.path.exists(run.socket)


@pytest.mark.parametrize("stdio", ["closed", "/dev/full"])
def test_run_with_closed_or_unusable_stdout_and_stderr_works(tmp_path, stdio):
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.stop()  # the context's own start: replaced by one with other standard streams
        run.proc = None
        run.start(stdio=stdio)
        run.wait_ready()
        assert run.status().returncode == 0
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0
        assert run.wait_no_leftovers() == []


def test_a_supervisor_frozen_past_its_startup_timeout_probes_again_before_judging(tmp_path):
    """SIGSTOP before the service was ready, SIGCONT after startup_timeout_s: the service got
    ready meanwhile; the time the supervisor spent frozen is not the service's fault."""
    with SupervisorRun(tmp_path, {"a": fake_service(startup_delay_s=1.5)}, startup_timeout_s=3.0,
                       readiness_period_s=0.2) as run:
        run.wait_for("the service to start", lambda: "a: started pid" in run.output(), period=0.01)
        run.signal(signal.SIGSTOP)
        try:
            time.sleep(5.0)
        finally:
            run.signal(signal.SIGCONT)
        run.wait_ready(timeout=10)
        assert "not ready after" not in run.output()
        run.signal(signal.SIGTERM)
        assert run.wait_exit(15) == 0


def test_a_stop_wakes_a_stopped_service_to_drain_and_exit_0(tmp_path):
    """A service process stopped (SIGSTOP: a debugger, a freezer) when the unit is told to stop:
    its SIGTERM is held until it runs again. Without a SIGCONT it was SIGKILLed at grace, and
    the stop lost its work (75)."""
    with SupervisorRun(tmp_path, {"a": fake_service(), "b": fake_service()}, grace_s=4.0,
                       liveness_failures=100) as run:
        run.wait_ready()
        pid = run.child_pid("a")
        os.kill(pid, signal.SIGSTOP)
        run.wait_for("a stopped", lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(20) == 0, run.output()
        out = run.output()
        assert "a: exited with code 0 (it was told to stop)" in out and "SIGKILL" not in out, out
        run.assert_clean()


@pytest.mark.parametrize("stdio", ["closed", "/dev/full"])
def test_a_config_error_with_unusable_stderr_still_exits_2(tmp_path, stdio):
    bad = tmp_path / "bad.toml"
    bad.write_text("[supervisor]\ngrace_s = -1\n")
    out = open(stdio, "wb") if stdio != "closed" else subprocess.DEVNULL

    def close_stdio():
        if stdio == "closed":
            os.close(1)
            os.close(2)

    try:
        r = subprocess.run([sys.executable, "-m", "supervisor", "run", "--config", str(bad)], cwd=ROOT, stdout=out,
                           stderr=out, preexec_fn=close_stdio, timeout=60)
    finally:
        if stdio != "closed":
            out.close()
    assert r.returncode == 2

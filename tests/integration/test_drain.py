"""A drain that runs out while a model call is still running ends by itself: the service
exits 75 within its drain window instead of waiting for the model's thread at
interpreter exit, so the supervisor never has to SIGKILL it. A real service (and a
real supervisor) with a scripted model call of a minute, stopped after a second."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time

import httpx

from tests.harness import ROOT, SupervisorRun, free_port
from tests.images import small_png
from tests.service_harness import ServiceProcess

APP = "tests.children.scripted_app:create_app"
MODEL_CALL_S = 60.0


def start_long_call(port: int, rid: str) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def call():
        try:
            return httpx.post(f"http://127.0.0.1:{port}/api/v1/echo?id={rid}&sleep={MODEL_CALL_S}",
                              content=small_png(), headers={"content-type": "image/png"}, timeout=MODEL_CALL_S + 30)
        except httpx.HTTPError as exc:
            return exc
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


def wait_on_model(port: int, rid: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rid in httpx.get(f"http://127.0.0.1:{port}/seen", timeout=5).json()["seen"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"{rid} never reached the model")


def test_a_drain_cut_during_a_model_call_exits_75_within_the_drain_window(tmp_path):
    drain_s = 1.0
    grace_s = drain_s + 2.0  # the supervisor's default margin after a service's drain
    with ServiceProcess(APP, {"max_batch_size": 1}, tmp_path, env={"ONECARD_DRAIN_S": str(drain_s)}) as svc:
        call = start_long_call(svc.port, "long")
        wait_on_model(svc.port, "long")
        t0 = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        code = svc.proc.wait(timeout=MODEL_CALL_S)  # without the fix: the whole model call
        elapsed = time.monotonic() - t0
        assert code == 75, svc.output()[-2000:]
        assert elapsed < grace_s, f"exited {elapsed:.1f} s after SIGTERM: past a grace of {grace_s} s"
        answer = call.result(timeout=10)
        # the client heard why (503 shutting_down) or saw the connection end; never a hang
        assert isinstance(answer, httpx.HTTPError) or answer.status_code == 503


def test_the_watchdog_ends_a_shutdown_that_hangs_after_the_drain(tmp_path):
    """Even when the app's own shutdown blocks (here: the event loop stalled by a handler
    when the drain ends), the process is gone by drain_s + min(1, drain_s / 2)."""
    drain_s = 1.0
    with ServiceProcess(APP, {"max_batch_size": 1, "loop_stall_s": 60}, tmp_path,
                        env={"ONECARD_DRAIN_S": str(drain_s)}) as svc:
        blocker = threading.Thread(target=lambda: _quiet_get(f"{svc.url}/block?s={MODEL_CALL_S}"), daemon=True)
        blocker.start()
        time.sleep(0.5)  # the loop is now stalled for a minute: uvicorn cannot even notice the signal
        t0 = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        code = svc.proc.wait(timeout=MODEL_CALL_S)
        assert code == 75 and time.monotonic() - t0 < drain_s + 2.0
        assert "exiting 75" in svc.output()


def _quiet_get(url: str) -> None:
    try:
        httpx.get(url, timeout=MODEL_CALL_S + 10)
    except httpx.HTTPError:
        pass


def test_the_unit_exits_75_and_the_supervisor_never_needs_sigkill(tmp_path):
    port = free_port()
    services = {"slow": {"app": APP, "port": port, "threads": 1, "env": {"PYTHONPATH": str(ROOT)},
                         "settings": {"max_batch_size": 1}}}
    with SupervisorRun(tmp_path, services, grace_s=3.0) as run:
        run.wait_ready()
        start_long_call(port, "long")
        wait_on_model(port, "long")
        run.signal(signal.SIGTERM)
        assert run.wait_exit(MODEL_CALL_S) == 75
        assert "SIGKILL" not in run.output(), run.output()[-2000:]
        assert not run.wait_no_leftovers()

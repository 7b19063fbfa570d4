"""The service process in a real uvicorn process: /healthz reflects a stuck model call,
readiness waits for real warm-up inferences, a model or app that cannot load exits 78, an
unexpected error is a 500 whose id is in the log, the input forms and limits, dry runs,
probes, /info, metrics and Server-Timing, credentials, the parent's death, the drain."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from tests.harness import ROOT
from tests.images import pixel_bomb_png, small_png
from tests.scripted_service import APP, PNG, answers_ready, hold_model, parallel, post, seen, wait_for
from tests.service_harness import ServiceProcess, probe


def _start_unwaited(svc: ServiceProcess) -> None:
    """Start the process without waiting for readiness (ServiceProcess.__exit__ stops it)."""
    svc._log = open(svc.log_path, "wb")
    svc.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.serve"], cwd=ROOT, env=svc.env,
                                stdout=svc._log, stderr=subprocess.STDOUT, start_new_session=True)


def test_stuck_model_call_fails_healthz(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1, "inference_timeout_s": 0.5}, tmp_path) as svc:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, svc, "?id=h&mode=hang&sleep=4")
            # stuck once the call has run past inference_timeout_s: asked until then (a loaded
            # machine may take a while to bring the request to the model)
            deadline = time.monotonic() + 3.5
            while (r := httpx.get(svc.url + "/healthz")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert r.status_code == 503 and r.json()["status"] == "stuck"
            assert probe(svc.probe_socket, "/healthz")[0] == 503
            fut.result()
        assert httpx.get(svc.url + "/healthz").status_code == 200


def test_readiness_waits_for_real_warm_up_inferences(tmp_path):
    svc = ServiceProcess(APP, {"warmup_runs": 3, "warmup_sleep_s": 0.4}, tmp_path)
    _start_unwaited(svc)
    try:
        states = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status, _ = probe(svc.probe_socket, "/readyz", timeout=1)
            except OSError:  # the probe socket is not there yet
                time.sleep(0.05)
                continue
            states.append(status)
            if status == 200:
                break
            time.sleep(0.05)
        assert states and states[-1] == 200, states
        assert states.count(503) >= 5  # not ready during 3 x 0.4 s of warm-up
        info = httpx.get(svc.url + "/info").json()
        # 3 warm-up calls, then the batch-time curve: 2 timed calls at batch size 1 (no batching)
        assert info["warmup_inferences"] == 5 and info["warmup_s"] >= 2.0
        assert seen(svc)["warmups"] == 5
        # what start-up made is out of the garbage collector's full scans (22 ms each in detect)
        assert info["frozen_objects"] > 10_000
    finally:
        svc.__exit__(None, None, None)


def test_a_model_that_will_not_load_exits_78(tmp_path):
    svc = ServiceProcess(APP, {"fail_load": True}, tmp_path)
    _start_unwaited(svc)
    try:
        assert svc.proc.wait(timeout=60) == 78
        assert "scripted load failure" in svc.output()
    finally:
        svc.__exit__(None, None, None)


def test_an_app_that_cannot_be_imported_exits_78(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ONECARD_SERVICE_APP": "no.such.module:create_app",
           "ONECARD_SERVICE_WATCH_PARENT": "0"}
    r = subprocess.run([sys.executable, "-m", "services.runtime.serve"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 78 and "no.such.module" in r.stderr


def test_unexpected_error_is_500_with_an_id_that_is_in_the_log(tmp_path):
    with ServiceProcess(APP, {}, tmp_path) as svc:
        r = post(svc, "?mode=boom")
        assert r.status_code == 500
        msg = r.json()["error"]["message"]
        error_id = msg.split("quote id ")[1].split()[0]
        time.sleep(0.2)
        assert f"unexpected error {error_id}" in svc.output()
        assert post(svc).status_code == 200


def test_input_forms_limits_and_errors(tmp_path):
    settings = {"max_body_bytes": 200_000, "max_pixels": 1_000_000}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        png = small_png()
        raw = post(svc, body=png)
        multi = httpx.post(svc.url + "/api/v1/echo", files={"image": ("a.png", png, "image/png")})
        js = httpx.post(svc.url + "/api/v1/echo", json={"image": base64.b64encode(png).decode()})
        form_params = httpx.post(svc.url + "/api/v1/echo", files={"image": ("a.png", png, "image/png")},
                                 data={"id": "viaform", "sleep": "0.01"})
        assert raw.status_code == multi.status_code == js.status_code == form_params.status_code == 200
        assert raw.json()["width"] == multi.json()["width"] == js.json()["width"] == 48
        assert form_params.json()["id"] == "viaform"

        def err(r):
            return r.status_code, r.json()["error"]["code"]

        assert err(post(svc, body=b"\0" * 300_000)) == (413, "body_too_large")
        assert err(post(svc, body=pixel_bomb_png())) == (413, "too_many_pixels")
        assert err(post(svc, "?sleep=abc")) == (422, "invalid_parameter")
        assert err(httpx.post(svc.url + "/api/v1/echo", json={"image": base64.b64encode(png).decode(),
                                                               "sleep": True})) == (422, "invalid_parameter")
        both = httpx.post(svc.url + "/api/v1/echo?id=a", json={"image": base64.b64encode(png).decode(), "id": "b"})
        assert err(both) == (422, "invalid_parameter")  # one field given two ways is refused
        assert httpx.get(svc.url + "/readyz").status_code == 200


def test_dry_run_validates_like_the_real_call_without_touching_the_model(tmp_path):
    with ServiceProcess(APP, {}, tmp_path) as svc:
        ok = post(svc, "?id=dry", headers={**PNG, "X-Onecard-Dry-Run": "1"})
        assert ok.status_code == 200 and ok.json()["valid"] is True and ok.json()["items"] == 1
        assert ok.json()["cost"]["items"] == 1 and ok.json()["cost"]["input_pixels"] > 0
        bad = post(svc, "?sleep=abc", headers={**PNG, "X-Onecard-Dry-Run": "1"})
        assert bad.status_code == 422
        assert seen(svc)["seen"] == []


def test_probes_info_metrics_and_server_timing(tmp_path):
    with ServiceProcess(APP, {}, tmp_path) as svc:
        r = post(svc, "?id=a")
        stages = dict(part.split(";dur=") for part in r.headers["server-timing"].split(", "))
        assert {"decode", "queue", "infer", "encode"} <= set(stages)
        info = httpx.get(svc.url + "/info").json()
        assert info["backend"] == "scripted" and info["limits"]["max_queue"] == 32
        assert info["model_label"] == "scripted/scripted/scripted" and "fastapi" in info["versions"]
        httpx.get(svc.url + "/info")
        text = httpx.get(svc.url + "/metrics").text
        assert 'onecard_requests_total{route="/api/v1/echo",status="200"} 1.0' in text
        assert 'onecard_request_duration_seconds_bucket{le="600.0",route="/api/v1/echo",status="200"} 1.0' in text
        assert 'onecard_request_duration_seconds_count{route="/info",status="200"} 2.0' in text
        for stage in ("decode", "queue", "infer", "encode"):
            assert f'onecard_stage_seconds_count{{route="/api/v1/echo",stage="{stage}"}} 1.0' in text
        assert "onecard_build_info{" in text
        stats = httpx.get(svc.url + "/stats").json()
        # /info calls are not model work: served counts the one echo only
        assert stats["served"] == 1 and stats["latency_p50_ms"] > 0 and stats["queue_depth"] == 0
        for path in ("/healthz", "/readyz", "/stats"):
            doc = httpx.get(svc.url + path).json()
            assert doc["instance"] == svc.instance and doc["pid"] == svc.proc.pid
            status, pdoc = probe(svc.probe_socket, path)
            assert status == 200 and pdoc["instance"] == svc.instance
        assert httpx.get(svc.url + "/healthz").headers["x-onecard-instance"] == svc.instance


def test_api_key(tmp_path):
    with ServiceProcess(APP, {"api_key_env": "SVC_KEY"}, tmp_path, env={"SVC_KEY": "s3cret"}) as svc:
        r = post(svc)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert post(svc, headers={**PNG, "Authorization": "Bearer wrong"}).status_code == 401
        assert post(svc, headers={**PNG, "Authorization": "Bearer s3cret"}).status_code == 200
        assert post(svc, headers={**PNG, "X-API-Key": "s3cret"}).status_code == 200
        assert httpx.get(svc.url + "/info").status_code == 401
        for open_path in ("/healthz", "/readyz", "/metrics", "/stats", "/openapi.json"):
            assert httpx.get(svc.url + open_path).status_code == 200
        schema = httpx.get(svc.url + "/openapi.json").json()
        assert set(schema["components"]["securitySchemes"]) == {"apiKey", "bearer"}


def test_http_basic_credentials_from_a_file_and_never_printed(tmp_path):
    creds = tmp_path / "users"
    creds.write_text("alice:wonder-land\nbob:b:with:colons\n")
    with ServiceProcess(APP, {"basic_auth_file": str(creds)}, tmp_path) as svc:
        assert post(svc).status_code == 401
        assert post(svc, auth=("alice", "wonder-land")).status_code == 200
        assert post(svc, auth=("bob", "b:with:colons")).status_code == 200
        assert post(svc, auth=("alice", "wrong")).status_code == 401
        assert post(svc, auth=("mallory", "wonder-land")).status_code == 401
        r = post(svc, headers={**PNG, "Authorization": "Basic !!!notbase64"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
        schema = httpx.get(svc.url + "/openapi.json").json()
        assert schema["components"]["securitySchemes"] == {"basic": {"type": "http", "scheme": "basic"}}
        time.sleep(0.2)
        assert "wonder-land" not in svc.output() and "wonder-land" not in httpx.get(svc.url + "/info").text


def test_service_exits_when_its_parent_disappears(tmp_path):
    svc = ServiceProcess(APP, {}, tmp_path)
    # a stand-in supervisor that starts the service and is then SIGKILLed
    code = ("import subprocess,sys,time\n"
            "p=subprocess.Popen([sys.executable,'-m','services.runtime.serve'])\n"
            "print(p.pid, flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=svc.env, stdout=subprocess.PIPE,
                              start_new_session=True)
    child = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        wait_for(lambda: answers_ready(svc), timeout=60, what="service ready")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(5)
        gone, alive = psutil.wait_procs([child], timeout=3)
        assert not alive
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except OSError:
            pass
        if child is not None:
            try:
                child.kill()
            except psutil.Error:
                pass
        parent.wait(5)


def test_sigterm_drains_in_flight_work_and_readiness_turns_503(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1}, tmp_path, env={"ONECARD_DRAIN_S": "5"}) as svc:
        blocker = hold_model(svc, 1.5)
        svc.proc.send_signal(signal.SIGTERM)
        status, doc = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(probe(svc.probe_socket, "/readyz")),
                               timeout=1.0, what="/readyz 503 while draining")
        assert doc["reason"] == "draining"
        assert blocker.result().status_code == 200
        assert svc.proc.wait(timeout=10) == 0


def test_threads_started_by_the_runtime_are_bounded(tmp_path):
    with ServiceProcess(APP, {"cpu_workers": 2}, tmp_path) as svc:
        parallel([lambda i=i: post(svc, f"?id=t{i}&decode_sleep=0.05") for i in range(20)])
        threads = psutil.Process(svc.proc.pid).threads()
        assert len(threads) < 16, len(threads)


def test_a_drain_that_runs_out_of_time_exits_75(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1}, tmp_path, env={"ONECARD_DRAIN_S": "0.5"}) as svc:
        blocker = hold_model(svc, 3.0)
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(timeout=10) == 75
        r = blocker.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"

"""The service runtime in a real uvicorn process: admission, deadlines, disconnects,
batching, faults, probes, limits, credentials. The scripted backend records every id
the model sees, so each test checks what reached the model, not only what came back."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.harness import ROOT
from tests.images import pixel_bomb_png, small_png
from tests.service_harness import ServiceProcess, probe

APP = "tests.children.scripted_app:create_app"
PNG = {"content-type": "image/png"}


def post(svc, params="", body=None, headers=PNG, timeout=30.0, **kw):
    return httpx.post(f"{svc.url}/api/v1/echo{params}", content=small_png() if body is None else body,
                      headers=headers, timeout=timeout, **kw)


def seen(svc):
    return httpx.get(svc.url + "/seen").json()


def parallel(fns):
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(lambda f: f(), fns))


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


def hold_model(svc, seconds: float, rid: str = "blocker"):
    """Start a request that occupies the model, and wait until the model really has it.
    Hold it for longer than what the test queues behind it takes to arrive on a loaded
    2-core machine: the test asserts what the queue does while the model is busy."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(post, svc, f"?id={rid}&sleep={seconds}")
    wait_for(lambda: rid in seen(svc)["seen"], what=f"{rid} on the model")
    pool.shutdown(wait=False)
    return fut


def test_queue_limit_gives_503_with_retry_after(tmp_path):
    with ServiceProcess(APP, {"max_queue": 2, "max_batch_size": 1}, tmp_path) as svc:
        blocker = hold_model(svc, 4)  # longer than the burst takes to arrive on a loaded machine
        rs = parallel([lambda i=i: post(svc, f"?id={i}") for i in range(8)])
        codes = sorted(r.status_code for r in rs)
        assert codes == [200, 200] + [503] * 6, codes
        r503 = next(r for r in rs if r.status_code == 503)
        assert r503.headers["retry-after"] == "1" and r503.json()["error"]["code"] == "overloaded"
        assert blocker.result().status_code == 200
        assert post(svc, "?id=after").status_code == 200  # still serving


def test_a_burst_cannot_pass_admission_together(tmp_path):
    """Admission counts a request the moment it arrives, before its body or decode: a
    burst of 40 against max_queue 4 admits at most max_queue plus what the model takes."""
    with ServiceProcess(APP, {"max_queue": 4, "max_batch_size": 1, "cpu_workers": 1}, tmp_path) as svc:
        hold_model(svc, 6)  # longer than the burst takes to arrive on a loaded machine
        rs = parallel([lambda i=i: post(svc, f"?id=x{i}&decode_sleep=0.05") for i in range(40)])
        ok = sum(r.status_code == 200 for r in rs)
        assert sum(r.status_code == 503 for r in rs) + ok == 40
        assert 1 <= ok <= 4, ok
        assert len([i for i in seen(svc)["seen"] if i.startswith("x")]) == ok


@pytest.mark.parametrize("batching", [False, True])
def test_deadline_gives_504_and_the_work_is_never_started(tmp_path, batching):
    settings = {"request_timeout_s": 0.8, "batching": batching, "max_batch_size": 4 if batching else 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        blocker = hold_model(svc, 1.5, "slow")
        late = post(svc, "?id=late")
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
        assert blocker.result().status_code == 200
        time.sleep(0.2)
        assert "late" not in seen(svc)["seen"]
        assert httpx.get(svc.url + "/stats").json()["queue_depth"] == 0


def _quit_while_queued(svc, rid: str) -> None:
    body = small_png()
    s = socket.create_connection(("127.0.0.1", svc.port))
    s.sendall(f"POST /api/v1/echo?id={rid} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n".encode()
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] >= 1, what=f"{rid} queued")
    s.close()


@pytest.mark.parametrize("batching", [False, True])
def test_client_disconnecting_while_queued_never_reaches_the_model(tmp_path, batching):
    settings = {"batching": batching, "max_batch_size": 4 if batching else 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        blocker = hold_model(svc, 4)
        _quit_while_queued(svc, "quitter")
        wait_for(lambda: httpx.get(svc.url + "/stats").json()["queue_depth"] == 0, what="the quitter dropped")
        assert blocker.result().status_code == 200
        assert post(svc, "?id=next").status_code == 200
        assert seen(svc)["seen"] == ["blocker", "next"]
        metrics = httpx.get(svc.url + "/metrics").text
        assert 'onecard_dropped_total{reason="client_gone"} 1.0' in metrics


def test_a_dropped_request_behind_others_frees_its_slot_at_once(tmp_path):
    """Dropping a queued request with others ahead of it (numpy payloads compare badly by
    value) must take it out of the queue now, not when the batch loop reaches it."""
    with ServiceProcess(APP, {"max_queue": 3, "max_batch_size": 1}, tmp_path) as svc:
        blocker = hold_model(svc, 4)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ahead = [pool.submit(post, svc, f"?id=ahead{i}") for i in range(2)]
            wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 2, what="two queued")
            _quit_while_queued(svc, "quitter")
            wait_for(lambda: httpx.get(svc.url + "/stats").json()["queue_depth"] == 2, what="slot freed")
            assert httpx.get(svc.url + "/stats").json()["items_pending"] == 2  # out of the queue too
            # the freed slot admits a newcomer (else: a spurious 503)
            newcomer = pool.submit(post, svc, "?id=newcomer")
            assert [f.result().status_code for f in ahead] == [200, 200]
            assert newcomer.result().status_code == 200
        assert blocker.result().status_code == 200
        assert "quitter" not in seen(svc)["seen"]


def test_batches_start_with_the_oldest_and_take_compatible_items_in_order(tmp_path):
    settings = {"batching": True, "max_batch_size": 3}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        blocker = hold_model(svc, 4)
        order = ["a1", "b1", "a2", "a3", "b2", "a4", "b3"]
        with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
            futs = []
            for rid in order:
                futs.append(pool.submit(post, svc, f"?id={rid}&key={rid[0]}"))
                n = len(futs)
                wait_for(lambda n=n: httpx.get(svc.url + "/stats").json()["items_pending"] == n,
                         what=f"{rid} queued")
            assert all(f.result().status_code == 200 for f in futs)
        assert blocker.result().status_code == 200
        batches = seen(svc)["batches"][1:]
        # the oldest (a1) heads the first batch with the a's behind it; then b1 (now oldest)
        assert batches == [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["a4"]]


def test_batching_groups_requests_and_each_caller_gets_its_own_result(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4, "max_wait_ms": 50}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id=r{i}&sleep=0.2") for i in range(12)])
        assert all(r.status_code == 200 for r in rs)
        assert [r.json()["id"] for r in rs] == [f"r{i}" for i in range(12)]
        batches = seen(svc)["batches"]
        assert max(len(b) for b in batches) == 4 and len(batches) < 12
        assert 'onecard_batch_size_bucket{le="4.0"}' in httpx.get(svc.url + "/metrics").text


def test_a_request_with_several_items_gets_them_all_in_order(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 3}, tmp_path) as svc:
        r = post(svc, "?id=m&items=5")
        assert r.status_code == 200 and r.json()["id"] == [f"m.{n}" for n in range(5)]
        assert seen(svc)["batches"] == [["m.0", "m.1", "m.2"], ["m.3", "m.4"]]


def test_a_bad_item_fails_alone_in_its_batch(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4, "max_wait_ms": 100}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id=r{i}&mode={'bad' if i == 1 else ''}") for i in range(4)])
        assert [r.status_code for r in rs] == [200, 422, 200, 200]
        assert rs[1].json()["error"]["message"] == "item r1 is bad"


def test_a_batch_whose_model_call_raises_is_retried_item_by_item(tmp_path):
    """The OOM item makes the whole batch call raise; the others still succeed alone."""
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4}, tmp_path) as svc:
        blocker = hold_model(svc, 3)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(post, svc, f"?id=r{i}&mode={'oom' if i == 1 else ''}") for i in range(3)]
            codes = [f.result().status_code for f in futs]
        assert blocker.result().status_code == 200
        assert codes == [200, 503, 200]
        batches = seen(svc)["batches"][1:]
        assert sorted(batches[0]) == ["r0", "r1", "r2"]  # one call for all three, which raised
        assert sorted(batches[1:]) == [["r0"], ["r1"], ["r2"]]  # then each alone


def test_out_of_memory_gives_503_and_the_service_carries_on(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1}, tmp_path) as svc:
        r = post(svc, "?id=big&mode=oom")
        assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"
        assert "retry-after" in r.headers
        assert post(svc, "?id=next").status_code == 200
        assert seen(svc)["freed"] == 1
        assert httpx.get(svc.url + "/healthz").status_code == 200


def test_a_cancelled_item_stops_only_when_its_whole_batch_is_cancelled(tmp_path):
    """Two cancellable items share a batch: one client leaves, the other's result still
    comes; when the last one leaves, the model call stops between 'steps'."""
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 2}, tmp_path) as svc:
        blocker = hold_model(svc, 3)
        body = small_png()

        def raw_request(rid):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(f"POST /api/v1/echo?id={rid}&sleep=1.5&cancellable=1 HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Type: image/png\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            return s

        leaver = raw_request("leaver")
        wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 1, what="leaver queued")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stayer = pool.submit(post, svc, "?id=stayer&sleep=1.5&cancellable=1")
            wait_for(lambda: ["leaver", "stayer"] in seen(svc)["batches"], what="the shared batch")
            leaver.close()
            r = stayer.result()
        assert r.status_code == 200 and r.json()["stopped"] is False
        assert blocker.result().status_code == 200
        blocker = hold_model(svc, 0.6, "blocker2")
        both = [raw_request("x1")]
        wait_for(lambda: httpx.get(svc.url + "/stats").json()["items_pending"] == 1, what="x1 queued")
        both.append(raw_request("x2"))
        wait_for(lambda: ["x1", "x2"] in seen(svc)["batches"], what="the second batch")
        for s in both:
            s.close()
        wait_for(lambda: "x1" in seen(svc)["stopped"], timeout=1.4, what="the call stopped between steps")
        assert blocker.result().status_code == 200


def test_stuck_model_call_fails_healthz(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1, "inference_timeout_s": 0.5}, tmp_path) as svc:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, svc, "?id=h&mode=hang&sleep=2.5")
            time.sleep(1.2)
            r = httpx.get(svc.url + "/healthz")
            assert r.status_code == 503 and r.json()["status"] == "stuck"
            assert probe(svc.probe_socket, "/healthz")[0] == 503
            fut.result()
        assert httpx.get(svc.url + "/healthz").status_code == 200


def _start_unwaited(svc: ServiceProcess) -> None:
    """Start the process without waiting for readiness (ServiceProcess.__exit__ stops it)."""
    svc._log = open(svc.log_path, "wb")
    svc.proc = subprocess.Popen([sys.executable, "-m", "services.runtime.serve"], cwd=ROOT, env=svc.env,
                                stdout=svc._log, stderr=subprocess.STDOUT, start_new_session=True)


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
        wait_for(lambda: _ready(svc), timeout=60, what="service ready")
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


def _ready(svc) -> bool:
    try:
        return httpx.get(svc.url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_max_queue_zero_serves_one_at_a_time_and_refuses_waiters(tmp_path):
    with ServiceProcess(APP, {"max_queue": 0, "max_batch_size": 1}, tmp_path) as svc:
        assert post(svc, "?id=alone").status_code == 200  # nothing to wait for: served
        blocker = hold_model(svc, 0.6, "first")
        assert post(svc, "?id=second").status_code == 503
        assert blocker.result().status_code == 200


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

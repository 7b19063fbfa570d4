"""The service runtime in a real uvicorn process: admission, deadlines, disconnects,
batching, faults, probes, limits and the API key."""

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
from tests.service_harness import ServiceProcess

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


def test_queue_limit_gives_503_with_retry_after(tmp_path):
    with ServiceProcess(APP, {"max_queue": 2, "max_batch_size": 1}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id={i}&sleep=0.4") for i in range(8)])
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 3 and 503 in codes, codes
        r503 = next(r for r in rs if r.status_code == 503)
        assert r503.headers["retry-after"] == "1"
        assert r503.json()["error"]["code"] == "overloaded"
        assert post(svc, "?id=after").status_code == 200  # still serving


@pytest.mark.parametrize("batching", [False, True])
def test_deadline_gives_504_and_the_work_is_never_started(tmp_path, batching):
    settings = {"request_timeout_s": 0.5, "batching": batching, "max_batch_size": 4 if batching else 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        slow, late = parallel([lambda: post(svc, "?id=slow&sleep=1.2"),
                               lambda: (time.sleep(0.1), post(svc, "?id=late"))[1]])
        assert slow.status_code == 200
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
        assert "late" not in seen(svc)["seen"]


@pytest.mark.parametrize("batching", [False, True])
def test_client_disconnecting_while_queued_never_reaches_the_model(tmp_path, batching):
    settings = {"batching": batching, "max_batch_size": 4 if batching else 1}
    with ServiceProcess(APP, settings, tmp_path) as svc:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(post, svc, "?id=blocker&sleep=1.5")
            time.sleep(0.3)  # blocker is on the model now
            body = small_png()
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(b"POST /api/v1/echo?id=quitter HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.3)  # queued behind the blocker
            s.close()
            assert blocker.result().status_code == 200
        assert post(svc, "?id=next").status_code == 200
        got = seen(svc)["seen"]
        assert "quitter" not in got and got == ["blocker", "next"]
        metrics = httpx.get(svc.url + "/metrics").text
        assert 'onecard_dropped_total{reason="client_gone"} 1.0' in metrics


def test_batching_groups_requests_and_each_caller_gets_its_own_result(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4, "max_wait_ms": 50}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id=r{i}&sleep=0.2") for i in range(12)])
        assert all(r.status_code == 200 for r in rs)
        assert [r.json()["id"] for r in rs] == [f"r{i}" for i in range(12)]
        batches = seen(svc)["batches"]
        assert max(len(b) for b in batches) == 4 and len(batches) < 12
        assert 'onecard_batch_size_bucket{le="4.0"}' in httpx.get(svc.url + "/metrics").text


def test_a_bad_item_fails_alone_in_its_batch(tmp_path):
    with ServiceProcess(APP, {"batching": True, "max_batch_size": 4, "max_wait_ms": 100}, tmp_path) as svc:
        rs = parallel([lambda i=i: post(svc, f"?id=r{i}&mode={'bad' if i == 1 else ''}") for i in range(4)])
        assert [r.status_code for r in rs] == [200, 422, 200, 200]
        assert rs[1].json()["error"]["message"] == "item r1 is bad"


def test_out_of_memory_gives_503_and_the_service_carries_on(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1}, tmp_path) as svc:
        r = post(svc, "?id=big&mode=oom")
        assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"
        assert "retry-after" in r.headers
        assert post(svc, "?id=next").status_code == 200
        assert seen(svc)["freed"] == 1
        assert httpx.get(svc.url + "/healthz").status_code == 200


def test_stuck_model_call_fails_healthz(tmp_path):
    with ServiceProcess(APP, {"max_batch_size": 1, "inference_timeout_s": 0.5}, tmp_path) as svc:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, svc, "?id=h&mode=hang&sleep=2.5")
            time.sleep(1.2)
            r = httpx.get(svc.url + "/healthz")
            assert r.status_code == 503 and r.json()["status"] == "stuck"
            fut.result()
        assert httpx.get(svc.url + "/healthz").status_code == 200


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
        assert raw.status_code == multi.status_code == js.status_code == 200
        assert raw.json()["width"] == multi.json()["width"] == js.json()["width"] == 48

        def err(r):
            return r.status_code, r.json()["error"]["code"]

        assert err(post(svc, body=b"\0" * 300_000)) == (413, "body_too_large")
        assert err(post(svc, body=pixel_bomb_png())) == (413, "too_many_pixels")
        assert err(post(svc, body=b"hello", headers={"content-type": "text/plain"})) == (415, "unsupported_media_type")
        assert err(post(svc, body=b"GIF89a" + b"\0" * 20, headers={"content-type": "image/gif"})) == (415, "unsupported_image")
        assert err(post(svc, body=png[:60])) == (400, "corrupt_image")
        assert err(post(svc, body=b"")) == (400, "empty_image")
        assert err(httpx.post(svc.url + "/api/v1/echo", content=b"{nope", headers={"content-type": "application/json"})) == (400, "bad_json")
        assert err(httpx.post(svc.url + "/api/v1/echo", json={"image": "!!!"})) == (400, "bad_base64")
        assert err(httpx.post(svc.url + "/api/v1/echo", json={"img": "x"})) == (422, "invalid_parameter")
        assert err(post(svc, "?sleep=abc")) == (422, "invalid_parameter")
        assert httpx.get(svc.url + "/readyz").status_code == 200


def test_probes_info_metrics_and_server_timing(tmp_path):
    with ServiceProcess(APP, {}, tmp_path) as svc:
        r = post(svc, "?id=a")
        stages = dict(part.split(";dur=") for part in r.headers["server-timing"].split(", "))
        assert {"decode", "queue", "infer", "encode"} <= set(stages)
        info = httpx.get(svc.url + "/info").json()
        assert info["backend"] == "scripted" and info["limits"]["max_queue"] == 32
        assert "fastapi" in info["versions"]
        text = httpx.get(svc.url + "/metrics").text
        assert 'onecard_requests_total{route="/api/v1/echo",status="200"} 1.0' in text
        for stage in ("decode", "queue", "infer", "encode"):
            assert f'onecard_stage_seconds_count{{stage="{stage}"}}' in text
        stats = httpx.get(svc.url + "/stats").json()
        assert stats["served"] == 1 and stats["latency_p50_ms"] > 0 and stats["queue_depth"] == 0


def test_api_key(tmp_path):
    with ServiceProcess(APP, {"api_key_env": "SVC_KEY"}, tmp_path, env={"SVC_KEY": "s3cret"}) as svc:
        r = post(svc)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert post(svc, headers={**PNG, "Authorization": "Bearer wrong"}).status_code == 401
        assert post(svc, headers={**PNG, "Authorization": "Bearer s3cret"}).status_code == 200
        assert post(svc, headers={**PNG, "X-API-Key": "s3cret"}).status_code == 200
        assert httpx.get(svc.url + "/info").status_code == 401
        for probe in ("/healthz", "/readyz", "/metrics", "/stats"):
            assert httpx.get(svc.url + probe).status_code == 200


def test_service_exits_when_its_parent_disappears(tmp_path):
    svc = ServiceProcess(APP, {}, tmp_path)
    # a stand-in supervisor that starts the service and is then SIGKILLed
    code = ("import subprocess,sys,time\n"
            "p=subprocess.Popen([sys.executable,'-m','services.runtime.serve'])\n"
            "print(p.pid, flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=svc.env, stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        svc.proc = child
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(svc.url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(5)
        gone, alive = psutil.wait_procs([child], timeout=3)
        assert not alive
    finally:
        for p in (parent.pid,):
            try:
                os.killpg(p, signal.SIGKILL)
            except OSError:
                pass
        parent.wait(5)


def test_max_queue_zero_serves_one_at_a_time_and_refuses_waiters(tmp_path):
    with ServiceProcess(APP, {"max_queue": 0, "max_batch_size": 1}, tmp_path) as svc:
        assert post(svc, "?id=alone").status_code == 200  # nothing to wait for: served
        first, second = parallel([lambda: post(svc, "?id=first&sleep=0.6"),
                                  lambda: (time.sleep(0.2), post(svc, "?id=second"))[1]])
        assert first.status_code == 200 and second.status_code == 503

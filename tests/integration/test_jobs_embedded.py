"""The jobs API on one unit with no queue configured (jobs in the process's memory), fed to
the unit's real services (detect on Haar, img2img on style transfer) and to a scripted
service for the failure paths. Every process is real; nothing is mocked."""

from __future__ import annotations

import base64
import io
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.images import astronaut, encode, pixel_bomb_png
from tests.integration.test_metrics import lint
from tests.jobs_harness import DETECT_APP, IMG2IMG_APP, TARGET_APP, Unit, b64, start_units
from tests.service_harness import probe

HAAR = "detect/haar/haarcascade_frontalface_default"
SCRIPTED = "scripted/scripted/m1"
WORK = "/api/v1/work"


def small_face() -> bytes:
    return encode(np.asarray(Image.fromarray(astronaut()).resize((160, 160))))


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    u = Unit(tmp_path_factory.mktemp("jobs-embedded"), "solo",
             targets={"detect": (DETECT_APP, {"backend": "haar", "warmup_runs": 1}),
                      "img2img": (IMG2IMG_APP, {"backend": "style", "max_side": 128, "warmup_runs": 1}),
                      "scripted": (TARGET_APP, {"model": "m1", "dry_run": True})},
             target_settings={"scripted": {"max_in_flight": 1}},
             queue={"max_attempts": 2}, max_image_bytes=200_000, max_body_bytes=1_000_000, max_waiting_polls=2)
    try:
        start_units(u)
        yield u
    finally:
        u.stop()


def test_detect_job_gives_what_a_direct_call_gives(unit):
    img = small_face()
    direct = httpx.post(unit.targets["detect"].url + "/api/v1/facedetect", json={"image": b64(img), "min_score": 0.4})
    assert direct.status_code == 200
    r = unit.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect",
                                        "params": {"min_score": 0.4}, "image": b64(img)})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.json()["state"] == "queued" and r.headers["location"] == f"/v1/jobs/{job_id}"
    done = unit.wait(job_id)
    assert done["state"] == "succeeded" and done["model"] == HAAR and done["node"] == "solo"
    assert done["attempts"] == 1 and done["progress"] == 1.0 and done["error"] is None
    assert done["result"] == direct.json()
    raw = unit.api.get(f"/v1/jobs/{job_id}/result")
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/json"
    assert raw.json() == direct.json()


def test_img2img_jobs_on_both_routes_return_the_image(unit):
    img = small_face()
    job = unit.submit("img2img", "/api/v1/img2img", params={"style": 3, "seed": 1, "format": "png"}, image=b64(img))
    done = unit.wait(job["id"])
    assert done["state"] == "succeeded", done
    raw = unit.api.get(f"/v1/jobs/{job['id']}/result")
    assert raw.headers["content-type"] == "image/png" and raw.headers["x-seed"] == "1"
    assert Image.open(io.BytesIO(raw.content)).size == (160, 160)  # the input size
    assert base64.b64decode(done["result"]["image"]) == raw.content and done["result"]["seed"] == "1"

    body = {"init_images": [b64(img)], "prompt": "x", "steps": 2, "seed": 5, "width": 96, "height": 64}
    job = unit.submit("img2img", "/sdapi/v1/img2img", body=body)
    done = unit.wait(job["id"])
    assert done["state"] == "succeeded", done
    webui = done["result"]
    assert set(webui) == {"images", "parameters", "info"}
    assert Image.open(io.BytesIO(base64.b64decode(webui["images"][0]))).size == (96, 64)


@pytest.mark.parametrize("fields,status,code", [
    ({"service": "nope", "route": "/api/v1/facedetect"}, 422, "unknown_service"),
    ({"service": "detect", "route": "/api/v1/other"}, 422, "unknown_route"),
    ({"service": "detect", "route": "/api/v1/facedetect", "model": "detect/haar/other.xml"}, 422, "unknown_model"),
    ({"service": "detect", "route": "/api/v1/facedetect", "model": SCRIPTED}, 422, "unknown_model"),
    ({"service": "detect", "route": "../../etc/passwd"}, 422, "invalid_parameter"),
    ({"service": "detect", "route": "/api/v1/facedetect", "image": "%%%not base64"}, 400, "bad_base64"),
    ({"service": "detect", "route": "/api/v1/facedetect", "image": b64(b"plain text, not an image")}, 415,
     "unsupported_image"),
    ({"service": "detect", "route": "/api/v1/facedetect", "image": b64(pixel_bomb_png())}, 413, "too_many_pixels"),
    ({"service": "detect", "route": "/api/v1/facedetect", "image": b64(encode(np.random.default_rng(0).integers(
        0, 255, (400, 400, 3), dtype=np.uint8)))}, 413, "image_too_large"),
    ({"service": "img2img", "route": "/sdapi/v1/img2img", "body": {"init_images": ["AAAA#"]}}, 400, "bad_base64"),
    ({"service": "detect", "route": "/api/v1/facedetect", "body": {}, "params": {}}, 422, "invalid_parameter"),
    ({"service": "detect", "route": "/api/v1/facedetect", "extra": 1}, 422, "invalid_parameter"),
    ({"route": "/api/v1/facedetect"}, 422, "invalid_parameter"),
])
def test_bad_jobs_are_refused_at_submit(unit, fields, status, code):
    r = unit.api.post("/v1/jobs", json=fields)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_malformed_requests_are_refused(unit):
    assert unit.api.post("/v1/jobs", content=b"{nope", headers={"content-type": "application/json"}) \
        .json()["error"]["code"] == "bad_json"
    r = unit.api.post("/v1/jobs", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = unit.api.post("/v1/jobs", content=b"[" * 1_200_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert unit.api.get("/v1/jobs/not-an-id").status_code == 404
    assert unit.api.get("/v1/jobs/" + "0" * 32).json()["error"]["code"] == "job_not_found"
    assert unit.api.delete("/v1/jobs/" + "0" * 32).status_code == 404


def test_a_service_with_dry_run_validates_submits_without_working(unit):
    before = unit.calls("scripted")
    r = unit.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {"tag": "dry", "sleep_s": -1}})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("sleep_s")
    job = unit.submit("scripted", WORK, body={"tag": "dry-ok", "sleep_s": 0})
    assert unit.wait(job["id"])["state"] == "succeeded"
    calls = unit.calls("scripted")
    assert calls["dry_runs"][len(before["dry_runs"]):] == ["dry", "dry-ok"]
    assert "dry" not in calls["started"] and calls["started"].count("dry-ok") == 1  # the dry run never worked


def test_detect_validates_every_submit_with_its_dry_run(unit):
    img = b64(small_face())
    for _ in range(2):  # not only until the first good job: the service keeps answering dry runs
        r = unit.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect",
                                            "params": {"min_score": 5}, "image": img})
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("min_score"), r.text
        good = unit.submit("detect", "/api/v1/facedetect", image=img)
        assert unit.wait(good["id"])["state"] == "succeeded"
    detect = next(t for t in unit.api.get("/info").json()["targets"] if t["name"] == "detect")
    assert detect["dry_run"] is True


def test_a_service_without_dry_run_still_rejects_bad_params_at_submit_then_at_run(tmp_path):
    """A service that runs a request marked as a dry run (it has no dry run): a bad one is refused
    by its own checks before any work (422 at submit); once a valid one shows that it has no dry
    run, submits get the structural checks only and a bad job fails with the service's own 422
    when it runs."""
    u = Unit(tmp_path, "fresh", targets={"scripted": (TARGET_APP, {"model": "m1", "dry_run": False})})
    try:
        start_units(u)
        r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {"tag": "b0", "sleep_s": -1}})
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("sleep_s"), r.text
        good = u.submit("scripted", WORK, body={"tag": "ok", "sleep_s": 0})
        assert u.wait(good["id"])["state"] == "succeeded"
        calls = u.calls("scripted")
        assert calls["started"].count("ok") == 2  # the probe that found no dry run, then the job
        assert u.api.get("/info").json()["targets"][0]["dry_run"] is False
        bad = u.submit("scripted", WORK, body={"tag": "b1", "sleep_s": -1})
        failed = u.wait(bad["id"])
        assert failed["state"] == "failed" and failed["attempts"] == 1
        assert failed["error"]["code"] == "invalid_parameter" and failed["error"]["status"] == 422
        raw = u.api.get(f"/v1/jobs/{bad['id']}/result")
        assert raw.status_code == 422 and raw.json()["error"]["code"] == "invalid_parameter"
    finally:
        u.stop()


def test_idempotency_key_returns_the_same_job(unit):
    img = b64(small_face())
    first = unit.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect", "image": img},
                          headers={"Idempotency-Key": "order-17"})
    again = unit.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect", "image": img},
                          headers={"Idempotency-Key": "order-17"})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"] and again.headers["idempotent-replayed"] == "true"
    other = unit.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect", "image": img,
                                            "params": {"max_faces": 1}}, headers={"Idempotency-Key": "order-17"})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    fresh = unit.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect", "image": img},
                          headers={"Idempotency-Key": "order-18"})
    assert fresh.json()["id"] != first.json()["id"]


def test_long_polls_beyond_max_waiting_polls_are_answered_after_a_pause(unit):
    """Two long polls wait for a queued job (max_waiting_polls 2): a third is answered after a
    pause (0.5-1 x Retry-After, not its 20 s: a client polling in a loop comes back no faster)
    with the job as it is, while the two still wait (each waiting poll holds a connection
    that can never make room for a newcomer); the two get the finished job."""
    import concurrent.futures
    blocker = unit.submit("scripted", WORK, body={"tag": "poll-blocker", "sleep_s": 3})
    unit.wait(blocker["id"], ("running",))
    queued = unit.submit("scripted", WORK, body={"tag": "polled", "sleep_s": 0})

    def long_poll() -> dict:
        r = httpx.get(f"{unit.api.base_url}/v1/jobs/{queued['id']}", params={"wait": 20, "result": "false"},
                      timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(long_poll) for _ in range(2)]
        deadline = time.monotonic() + 10
        while unit.stats()["jobs"]["long_polls_waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        third = unit.job(queued["id"], wait=20, result="false")
        paused = time.monotonic() - t0
        assert third["state"] == "queued" and not any(f.done() for f in waiting)
        assert 0.5 <= paused < 10, paused
        assert [f.result()["state"] for f in waiting] == ["succeeded", "succeeded"]


def test_cancel_a_queued_job_and_it_never_runs(unit):
    blocker = unit.submit("scripted", WORK, body={"tag": "blocker", "sleep_s": 2})
    unit.wait(blocker["id"], ("running",))
    queued = unit.submit("scripted", WORK, body={"tag": "never", "sleep_s": 0})
    assert unit.job(queued["id"])["state"] == "queued"  # one slot (max_in_flight 1), and it is taken
    r = unit.api.delete(f"/v1/jobs/{queued['id']}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert unit.wait(blocker["id"])["state"] == "succeeded"
    after = unit.submit("scripted", WORK, body={"tag": "after", "sleep_s": 0})
    assert unit.wait(after["id"])["state"] == "succeeded"  # ran after the cancelled one would have
    assert "never" not in unit.calls("scripted")["started"]
    assert unit.job(queued["id"])["state"] == "cancelled"
    assert unit.api.get(f"/v1/jobs/{queued['id']}/result").json()["error"]["code"] == "job_cancelled"
    assert unit.api.delete(f"/v1/jobs/{after['id']}").status_code == 409  # finished: nothing to cancel


def test_cancel_a_running_job_closes_its_request(unit):
    job = unit.submit("scripted", WORK, body={"tag": "long", "sleep_s": 60})
    unit.wait(job["id"], ("running",))
    deadline = time.monotonic() + 10
    while "long" not in unit.calls("scripted")["started"]:
        assert time.monotonic() < deadline, "the job never reached the service"
        time.sleep(0.05)
    r = unit.api.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    done = unit.wait(job["id"], timeout=10)
    assert done["state"] == "cancelled" and done["error"]["code"] == "cancelled"
    deadline = time.monotonic() + 5
    while "long" not in unit.calls("scripted")["disconnected"]:
        assert time.monotonic() < deadline, "the service never saw its client go"
        time.sleep(0.05)
    assert "long" not in unit.calls("scripted")["finished"]


def test_5xx_is_retried_then_dead_lettered_and_4xx_fails_at_once(unit):
    dead_before = unit.stats()["jobs"]["streams"]
    job = unit.submit("scripted", WORK, body={"tag": "boom", "status": 500, "code": "exploded"})
    done = unit.wait(job["id"])
    assert done["state"] == "failed" and done["attempts"] == 2  # max_attempts
    assert done["error"]["code"] == "exploded" and done["error"]["status"] == 500
    assert unit.calls("scripted")["started"].count("boom") == 2
    job = unit.submit("scripted", WORK, body={"tag": "flaky", "status": 502, "times": 1})
    done = unit.wait(job["id"])
    assert done["state"] == "succeeded" and done["attempts"] == 2
    job = unit.submit("scripted", WORK, body={"tag": "nope", "status": 404, "code": "no_such_thing"})
    done = unit.wait(job["id"])
    assert done["state"] == "failed" and done["attempts"] == 1 and done["error"]["code"] == "no_such_thing"
    assert unit.calls("scripted")["started"].count("nope") == 1
    dead = {s["model"]: s["dead_lettered"] for s in unit.stats()["jobs"]["streams"]}
    was = {s["model"]: s["dead_lettered"] for s in dead_before}
    assert dead[SCRIPTED] == was[SCRIPTED] + 1 and dead[HAAR] == was[HAAR]


def test_503_from_the_service_is_backpressure_not_an_attempt(unit):
    job = unit.submit("scripted", WORK, body={"tag": "busy", "status": 503, "code": "overloaded",
                                              "retry_after": "0.1", "times": 3})
    done = unit.wait(job["id"])
    assert done["state"] == "succeeded" and done["attempts"] == 1
    assert unit.calls("scripted")["started"].count("busy") == 4
    assert "onecard_jobs_backpressure_total 3.0" in unit.api.get("/metrics").text


def test_stats_and_metrics_show_the_queue(unit):
    job = unit.submit("scripted", WORK, body={"tag": "figures", "sleep_s": 0})  # whatever ran before
    assert unit.wait(job["id"])["state"] == "succeeded"
    stats = unit.stats()
    assert {"queue_depth", "in_flight", "served", "errors", "latency_p50_ms", "latency_p99_ms"} <= set(stats)
    jobs = stats["jobs"]
    assert jobs["mode"] == "embedded" and jobs["node"] == "solo"
    labels = {s["model"] for s in jobs["streams"]}
    assert len(labels) == 3 and {HAAR, SCRIPTED} < labels and any(x.startswith("img2img/style/") for x in labels)
    for s in jobs["streams"]:
        assert {"stream", "model", "lag", "pending", "in_progress", "dead_lettered"} <= set(s)
    assert jobs["stages"]["queued"]["count"] > 0 and jobs["stages"]["running"]["p50_ms"] > 0
    text = unit.api.get("/metrics").text
    for name in ("onecard_jobs_stream_lag{", "onecard_jobs_pending{", "onecard_jobs_in_progress{",
                 "onecard_jobs_dead_lettered_total{", 'onecard_jobs_stage_seconds_bucket{le="600.0",stage="running"}',
                 'onecard_jobs_total{state="succeeded"}'):
        assert name in text, name
    assert lint(text) == []
    if shutil.which("promtool"):  # Debian: prometheus
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
    info = unit.api.get("/info").json()
    assert set(info["model_labels"]) == labels and info["queue"]["mode"] == "embedded"


def test_results_expire_and_the_api_key_guards_the_api(tmp_path):
    u = Unit(tmp_path, "ttl", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             queue={"results_ttl_s": 1.0}, api_key="s3cret")
    try:
        start_units(u)
        assert u.api.post("/v1/jobs", json={}).status_code == 401
        assert u.api.get("/healthz").status_code == 200 and u.api.get("/readyz").json()["ready"] is True
        u.api.headers["x-api-key"] = "s3cret"
        job = u.submit("scripted", WORK, body={"tag": "t"})
        assert u.wait(job["id"])["state"] == "succeeded"
        assert u.api.get(f"/v1/jobs/{job['id']}/result").status_code == 200
        deadline = time.monotonic() + 10
        while u.api.get(f"/v1/jobs/{job['id']}").status_code == 200:
            assert time.monotonic() < deadline, "the result never expired"
            time.sleep(0.1)
        r = u.api.get(f"/v1/jobs/{job['id']}/result")
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    finally:
        u.stop()


def test_long_poll_answers_when_the_job_finishes(unit):
    job = unit.submit("scripted", WORK, body={"tag": "slow-poll", "sleep_s": 1.0})
    # if the finish did not wake the poll, it would hold for max_wait_s (10 s) and the client give up first
    r = unit.api.get(f"/v1/jobs/{job['id']}", params={"wait": 30}, timeout=8)
    assert r.status_code == 200 and r.json()["state"] == "succeeded" and r.json()["result"]["tag"] == "slow-poll"
    assert unit.api.get(f"/v1/jobs/{job['id']}", params={"wait": 5}, timeout=2).json()["state"] == "succeeded"
    assert unit.api.get(f"/v1/jobs/{job['id']}", params={"wait": "soon"}).status_code == 422
    assert unit.api.get("/v1/jobs/" + "1" * 32, params={"wait": 1}).status_code == 404


def test_probes_answer_on_the_private_socket_while_clients_hold_every_connection(tmp_path):
    """The supervisor probes the jobs service on its unix socket, served apart from the public
    port: clients holding every public connection cannot make a working unit look dead."""
    sock_dir = tempfile.mkdtemp(prefix="oc-", dir="/tmp")  # a unix socket path must stay short
    u = Unit(tmp_path, "held", targets={"scripted": (TARGET_APP, {"model": "m1", "dry_run": True})},
             max_connections=4, body_timeout_s=120, min_body_rate_bytes_s=0, connection_queue_timeout_s=0)
    path = os.path.join(sock_dir, "jobs.sock")
    u.jobs.env.update(ONECARD_PROBE_SOCKET=path, ONECARD_INSTANCE_TOKEN="tok-jobs")
    held = []
    sending = threading.Event()

    def keep_sending() -> None:  # a byte of each body every 0.25 s: none of them stalls, none makes room
        while sending.is_set():
            for s in held:
                s.send(b" ")
            time.sleep(0.25)
    trickle = threading.Thread(target=keep_sending, daemon=True)
    try:
        start_units(u)
        for _ in range(4):  # every connection the public port allows, each mid-body (a request in
            # progress: never closed to make room for a newcomer, as an idle one or a head would be)
            s = socket.create_connection(("127.0.0.1", u.jobs.port))
            s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            held.append(s)
        sending.set()
        trickle.start()
        deadline = time.monotonic() + 10
        while True:  # the public port is full: a newcomer whose request is still coming is refused
            with socket.create_connection(("127.0.0.1", u.jobs.port)) as s:
                s.settimeout(5)
                s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{")
                try:
                    refused = b"too_many_connections" in s.recv(4096)
                except OSError:
                    refused = False
            if refused:
                break
            assert time.monotonic() < deadline, "the public port still took connections"
        # a probe's whole request is still taken beyond the limit on the public port too
        assert httpx.get(u.jobs.url + "/healthz", timeout=5).status_code == 200
        status, doc = probe(path, "/healthz")
        assert (status, doc["status"], doc["instance"], doc["pid"]) == (200, "ok", "tok-jobs", u.jobs.proc.pid)
        status, doc = probe(path, "/readyz")
        assert (status, doc["ready"], doc["instance"]) == (200, True, "tok-jobs")
        status, doc = probe(path, "/stats")
        assert status == 200 and doc["jobs"]["mode"] == "embedded" and doc["queue_depth"] == 0
        status, doc = probe(path, "/metrics")
        assert status == 200 and "onecard_jobs" in doc["text"]
    finally:
        sending.clear()
        if trickle.is_alive():
            trickle.join()
        for s in held:
            s.close()
        u.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)

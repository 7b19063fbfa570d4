"""The jobs service against hostile clients and a hostile environment: bodies nested deep or
with numbers that are not numbers, paths that try to leave their route, control routes sent
as jobs, services without an OpenAPI document, an Idempotency-Key reused for another job,
results too large to keep, a Redis that stops answering, a flood of requests against a
bounded Redis pool, a queue URL variable that is missing. Real processes and sockets; a real
redis-server; every process is stopped by the test that started it."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import psutil
import pytest

from tests.harness import ROOT, SupervisorRun, fake_service, free_port
from tests.jobs_harness import IMG2IMG_APP, JOBS_APP, TARGET_APP, Proc, Unit, start_units
from tests.redis_server import RedisServer

WORK = "/api/v1/work"
SCRIPTED = "scripted/scripted/m1"
BARE = "bare/scripted/m2"
MAX_RESULT = 200_000


def error_of(r: httpx.Response) -> dict:
    """The JSON error envelope, asserted present: never a bare 500 or a text body."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    doc = r.json()
    assert set(doc) == {"error"} and isinstance(doc["error"]["message"], str), doc
    return doc["error"]


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    """scripted publishes an OpenAPI document; bare publishes none and its routes are
    declared in the config; blank publishes none and declares none; flaky answers 503 to its
    first fetches of the document; img2img is the real one."""
    u = Unit(tmp_path_factory.mktemp("jobs-hostile"), "hostile",
             targets={"scripted": (TARGET_APP, {"model": "m1", "dry_run": True}),
                      "bare": (TARGET_APP, {"model": "m2", "openapi": False}),
                      "blank": (TARGET_APP, {"model": "m3", "openapi": False}),
                      "flaky": (TARGET_APP, {"model": "m4", "openapi_failures": 3}),
                      "img2img": (IMG2IMG_APP, {"backend": "style", "max_side": 64, "warmup_runs": 1})},
             target_settings={"bare": {"routes": [WORK]}},
             max_json_depth=16, max_result_bytes=MAX_RESULT, max_body_bytes=100_000,
             max_connections=64, header_timeout_s=1.0, max_header_bytes=8192)
    try:
        start_units(u)
        yield u
    finally:
        u.stop()


# ---- bodies ---------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [15, 900, 5000, 40_000])
def test_a_body_nested_too_deep_is_400_json_too_deep(unit, depth):
    raw = '{"service": "scripted", "route": "/api/v1/work", "body": {"x": ' + "[" * depth + "]" * depth + "}}"
    r = unit.api.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "json_too_deep" and "16" in err["message"], err


def test_a_body_exactly_at_the_depth_limit_is_a_job(unit):
    depth = 16 - 2  # the envelope and "body" are two levels; the innermost list is one
    body = {"x": json.loads("[" * depth + "]" * depth)}
    done = unit.wait(unit.submit("scripted", WORK, body=body)["id"])
    assert done["state"] == "succeeded", done


def test_deep_nesting_inside_the_byte_limit_never_breaks_the_service(unit):
    for opener in ("[", '{"a":'):
        raw = b'{"service":"scripted","route":"/api/v1/work","params":{"p":' + opener.encode() * 15_000
        r = unit.api.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and error_of(r)["code"] in ("bad_json", "json_too_deep"), r.text
    assert unit.api.get("/healthz").status_code == 200


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_numbers_that_are_not_finite_are_422(unit, number):
    raw = '{"service": "scripted", "route": "/api/v1/work", "params": {"sleep_s": %s}}' % number
    r = unit.api.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and error_of(r)["code"] == "invalid_parameter", r.text


@pytest.mark.parametrize("doc", [
    {"service": 5, "route": WORK}, {"service": "scripted", "route": 5}, {"service": True, "route": WORK},
    {"service": "scripted", "route": WORK, "params": []}, {"service": "scripted", "route": WORK, "body": "x"},
    {"service": "scripted", "route": WORK, "model": 1.5}, {"service": "scripted", "route": [WORK]},
    {"service": "scripted", "route": WORK, "image": 7}, {"service": "scripted", "route": WORK, "extra": 1},
    [], "job", 1])
def test_wrong_types_are_422(unit, doc):
    r = unit.api.post("/v1/jobs", json=doc)
    assert r.status_code == 422 and error_of(r)["code"] == "invalid_parameter", r.text


def test_a_body_over_the_limit_is_413_declared_or_chunked(unit):
    big = b'{"service":"scripted","route":"/api/v1/work","params":{"p":"' + b"x" * 200_000 + b'"}}'
    r = unit.api.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"

    def chunks():
        for i in range(0, len(big), 16384):
            yield big[i:i + 16384]
    r = unit.api.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"


@pytest.mark.parametrize("raw,fragment", [
    (b'{"service": "scripted", "route": "/api/v1/work", "params": {"x": "\\ud800"}}', "surrogate"),
    (b'{"service": "scripted", "route": "/api/v1/work", "body": {"\\udfff": 1}}', "surrogate"),
    (b'{"service": "scripted", "route": "/api/v1/work", "model": "\\ud800"}', "model"),
    (b'{"service": "\\ud800", "route": "/api/v1/work"}', "service"),
    (b'{"service": "scripted", "route": "/api/v1/\\ud800"}', "route")])
def test_unpaired_surrogates_are_422_not_500(unit, raw, fragment):
    r = unit.api.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert fragment in error_of(r)["message"], r.text


def test_a_client_gone_mid_upload_leaves_no_error_behind(unit):
    before = len(unit.jobs.log_path.read_bytes())
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", unit.jobs.port), timeout=5) as s:
            s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 90000\r\n\r\n" + b'{"service": "scripted", ' + b" " * 4000)
            time.sleep(0.2)
    time.sleep(0.5)
    assert unit.api.get("/healthz").status_code == 200
    log = unit.jobs.log_path.read_bytes()[before:].decode(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


# ---- paths and ids -----------------------------------------------------------------------
@pytest.mark.parametrize("route", [
    WORK + "\n", WORK + "\r\n", "/api/v1/./work", "/api/v1/work/.", "/api/v1/../v1/work", "/api/v1/work/..",
    "/./api/v1/work", "/api/v1/...", "api/v1/work", "/api//v1/work", "/api/v1/w\u00f6rk", "/api/v1/work?x=1",
    "/api/v1/work#x", "/api/v1/%2e%2e/work", "/api/v1/work\x00", "/" + "a/" * 200, ""])
def test_a_route_that_is_not_a_plain_path_is_refused(unit, route):
    for service in ("scripted", "bare"):
        r = unit.api.post("/v1/jobs", json={"service": service, "route": route, "params": {"tag": "route-probe"}})
        assert r.status_code == 422 and error_of(r)["code"] == "invalid_parameter", (service, route, r.text)
    assert "route-probe" not in unit.calls("bare")["started"]


@pytest.mark.parametrize("suffix", ["%0A", "%0D%0A", "%00", "%20", "%C3%A9", "A"])
def test_a_job_id_with_anything_after_its_32_hex_digits_is_not_an_id(unit, suffix):
    job_id = unit.submit("scripted", WORK, params={"tag": "id"})["id"]
    unit.wait(job_id)
    for method, path in (("GET", f"/v1/jobs/{job_id}{suffix}"), ("GET", f"/v1/jobs/{job_id}{suffix}/result"),
                         ("DELETE", f"/v1/jobs/{job_id}{suffix}")):
        r = unit.api.request(method, path)
        assert r.status_code == 404, (path, r.text)
        assert error_of(r) == {"code": "job_not_found", "message": "no such job (ids are 32 hex digits)"}, path


@pytest.mark.parametrize("job_id", ["\u0661" * 32, "\uff10" * 32, "A" * 32, "g" * 32, "0" * 31, "0" * 33])
def test_unicode_and_near_miss_ids_are_404(unit, job_id):
    r = unit.api.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 404 and error_of(r)["code"] == "job_not_found"


@pytest.mark.parametrize("key", ["k\u00e9y", "a b", "", "x" * 256])
def test_a_bad_idempotency_key_is_400(unit, key):
    r = unit.api.post("/v1/jobs", json={"service": "scripted", "route": WORK},
                      headers={"Idempotency-Key": key.encode()})
    assert r.status_code == 400 and error_of(r)["code"] == "bad_idempotency_key", r.text


def test_wait_must_be_a_number_of_seconds(unit):
    job_id = unit.submit("scripted", WORK, params={"tag": "wait"})["id"]
    for wait in ("true", "nan", "inf", "-1", "1,5", "\u0661", "\uff11", "0x10", "1e999", "9" * 400, ""):
        r = unit.api.get(f"/v1/jobs/{job_id}", params={"wait": wait})
        assert r.status_code == 422 and error_of(r)["code"] == "invalid_parameter", (wait, r.text)
    assert unit.api.get(f"/v1/jobs/{job_id}", params={"wait": "10"}).json()["state"] == "succeeded"


# ---- which routes are jobs -------------------------------------------------------------
def test_control_routes_are_not_job_routes(unit):
    for service, route in (("img2img", "/sdapi/v1/interrupt"), ("img2img", "/sdapi/v1/skip"),
                           ("img2img", "/sdapi/v1/options"), ("img2img", "/sdapi/v1/refresh-checkpoints"),
                           ("scripted", "/api/v1/reset")):
        r = unit.api.post("/v1/jobs", json={"service": service, "route": route, "body": {"sd_model_checkpoint": "x"}})
        assert r.status_code == 422, (route, r.text)
        err = error_of(r)
        assert err["code"] == "not_a_job_route" and route in err["message"], err
    # the options were not touched by a dry run either
    opts = httpx.get(unit.targets["img2img"].url + "/sdapi/v1/options", timeout=10).json()
    assert opts.get("sd_model_checkpoint") != "x"
    routes = {t["name"]: t["routes"] for t in unit.api.get("/info").json()["targets"]}
    assert routes["img2img"] == ["/api/v1/img2img", "/sdapi/v1/extra-batch-images", "/sdapi/v1/extra-single-image",
                                 "/sdapi/v1/img2img", "/sdapi/v1/png-info", "/sdapi/v1/txt2img"]
    assert routes["scripted"] == [WORK]


def test_a_service_without_openapi_takes_only_its_declared_routes(unit):
    r = unit.api.post("/v1/jobs", json={"service": "bare", "route": "/api/v1/other", "params": {}})
    assert r.status_code == 422 and error_of(r)["code"] == "unknown_route", r.text
    done = unit.wait(unit.submit("bare", WORK, params={"tag": "bare"})["id"])
    assert done["state"] == "succeeded" and done["result"]["tag"] == "bare", done
    # no OpenAPI document and no routes declared: nothing is a job route
    r = unit.api.post("/v1/jobs", json={"service": "blank", "route": WORK, "params": {}})
    assert r.status_code == 422 and error_of(r)["code"] == "unknown_route", r.text
    assert "blank" in error_of(r)["message"] or "routes: []" in error_of(r)["message"]
    assert unit.calls("blank")["started"] == []


def test_a_document_that_fails_for_a_moment_is_fetched_again_not_taken_as_no_routes(unit):
    """503s on /openapi.json while the service is busy are retried; taken as 'no document',
    they would have failed every job of that model on every unit until a restart."""
    done = unit.wait(unit.submit("flaky", WORK, params={"tag": "flaky"})["id"])
    assert done["state"] == "succeeded" and done["result"]["tag"] == "flaky", done
    assert "openapi.json answered 503" in unit.jobs.output()


# ---- idempotency ------------------------------------------------------------------------
def idempotency_rules(u: Unit, key: str) -> None:
    h = {"Idempotency-Key": key}
    first = u.submit("scripted", WORK, headers=h, params={"tag": "idem"})
    again = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "params": {"tag": "idem"}}, headers=h)
    assert again.status_code == 202 and again.json()["id"] == first["id"]
    assert again.headers["idempotent-replayed"] == "true"
    for other in ({"service": "bare", "route": WORK, "params": {"tag": "idem"}},            # another service
                  {"service": "scripted", "route": WORK, "params": {"tag": "idem2"}},       # another body
                  {"service": "scripted", "route": WORK, "model": SCRIPTED, "params": {"tag": "idem", "x": 1}}):
        r = u.api.post("/v1/jobs", json=other, headers=h)
        assert r.status_code == 422, (other, r.text)
        err = error_of(r)
        assert err["code"] == "idempotency_key_reused" and first["id"] in err["message"], err


def test_an_idempotency_key_reused_for_another_job_is_422(unit):
    idempotency_rules(unit, f"hostile-{time.monotonic_ns()}")


# ---- results ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True])
def test_a_result_over_max_result_bytes_fails_the_job_and_the_consumer_goes_on(unit, chunked):
    huge = {"tag": "huge", "pad": MAX_RESULT * 2, "chunked": chunked}
    done = unit.wait(unit.submit("scripted", WORK, params=huge)["id"])
    assert done["state"] == "failed", done
    assert done["error"]["code"] == "result_too_large" and str(MAX_RESULT) in done["error"]["message"], done
    assert done["attempts"] == 1
    ok = unit.wait(unit.submit("scripted", WORK, params={"tag": "after-huge", "pad": MAX_RESULT // 2,
                                                          "chunked": chunked})["id"])
    assert ok["state"] == "succeeded" and len(ok["result"]["pad"]) == MAX_RESULT // 2
    assert unit.api.get("/healthz").status_code == 200


# ---- connections -------------------------------------------------------------------------
def test_a_header_flood_is_431_and_the_service_answers_after(unit):
    with socket.create_connection(("127.0.0.1", unit.jobs.port), timeout=5) as s:
        s.sendall(b"GET /v1/jobs/" + b"0" * 32 + b" HTTP/1.1\r\nHost: x\r\n" + b"X-Flood: y\r\n" * 5000 + b"\r\n")
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except OSError:
            pass
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert unit.api.get("/healthz").status_code == 200


def test_idle_connections_are_closed_and_do_not_lock_out_clients(unit):
    socks = []
    try:
        for _ in range(80):  # more than max_connections, each sending nothing
            socks.append(socket.create_connection(("127.0.0.1", unit.jobs.port), timeout=5))
        time.sleep(2.5)  # header_timeout_s = 1: every idle one has been closed
        r = httpx.get(unit.jobs.url + "/v1/jobs/" + "0" * 32, timeout=10)
        assert r.status_code == 404 and error_of(r)["code"] == "job_not_found"
    finally:
        for s in socks:
            s.close()


# ---- the embedded queue's bounds ---------------------------------------------------------
def test_the_embedded_queue_evicts_its_oldest_finished_jobs(tmp_path):
    u = Unit(tmp_path, "small", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             target_settings={"scripted": {"max_in_flight": 1}},
             queue={"max_finished_jobs": 3, "max_results_bytes": 100_000, "max_queued_bytes": 100_000},
             max_result_bytes=50_000)
    try:
        start_units(u)
        ids = []
        for i in range(5):  # one after the other: each is read before a later one can evict it
            ids.append(u.submit("scripted", WORK, params={"tag": f"j{i}"})["id"])
            assert u.wait(ids[-1])["state"] == "succeeded"
        seen = [u.api.get(f"/v1/jobs/{i}").status_code for i in ids]
        assert seen == [404, 404, 200, 200, 200], seen
        # by bytes: three results of 40 kB do not fit in 100 kB; the oldest goes
        big = []
        for i in range(3):
            big.append(u.submit("scripted", WORK, params={"tag": f"b{i}", "pad": 40_000})["id"])
            assert u.wait(big[-1])["state"] == "succeeded"
        seen = [u.api.get(f"/v1/jobs/{i}", params={"result": "false"}).status_code for i in big]
        assert seen == [404, 200, 200], seen
        assert u.api.get(f"/v1/jobs/{big[2]}/result").status_code == 200
        # the bodies of waiting jobs: one runs for a while, three of 30 kB wait, a fourth does not fit
        held = [u.submit("scripted", WORK, params={"tag": "hold", "sleep_s": 2})["id"]]
        held += [u.submit("scripted", WORK, params={"tag": f"q{i}", "p": "x" * 30_000})["id"] for i in range(3)]
        r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "params": {"p": "x" * 30_000}})
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert error_of(r)["code"] == "queue_full" and "max_queued_bytes" in error_of(r)["message"]
        assert u.wait(held[-1])["state"] == "succeeded"  # the last to run (the first are evicted by now)
        room = u.submit("scripted", WORK, params={"tag": "room", "p": "x" * 30_000})
        assert u.wait(room["id"])["state"] == "succeeded"
    finally:
        u.stop()


# ---- Redis ---------------------------------------------------------------------------------
def redis_connections(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_redis_that_hangs_gives_503_quickly_and_a_bounded_pool(tmp_path):
    srv = RedisServer(tmp_path)
    u = Unit(tmp_path, "stuck", targets={"scripted": (TARGET_APP, {"model": "m1"}),
                                          "bare": (TARGET_APP, {"model": "m2", "openapi": False})},
             target_settings={"bare": {"routes": [WORK]}},
             queue={"url": srv.url, "prefix": "stuck", "op_timeout_s": 1.0, "max_connections": 4})
    try:
        srv.start()
        start_units(u)
        idempotency_rules(u, "stuck-key")
        job_id = u.submit("scripted", WORK, params={"tag": "before"})["id"]
        assert u.wait(job_id)["state"] == "succeeded"
        srv.pause()
        for method, path, body in (("POST", "/v1/jobs", {"service": "scripted", "route": WORK, "params": {}}),
                                   ("GET", f"/v1/jobs/{job_id}", None), ("GET", f"/v1/jobs/{job_id}/result", None),
                                   ("DELETE", f"/v1/jobs/{job_id}", None)):
            t0 = time.monotonic()
            r = u.api.request(method, path, json=body, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 503, (path, r.text)
            assert error_of(r)["code"] == "queue_unavailable" and r.headers["retry-after"], r.text
            assert took < 2.5, (path, took)  # op_timeout_s + slack; without a deadline: 3 tries of 1 s
        # a flood while Redis hangs: each request waits for one of 4 pooled connections
        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            futs = [pool.submit(httpx.get, f"{u.jobs.url}/v1/jobs/{job_id}", timeout=30) for _ in range(48)]
            peak = 0
            while not all(f.done() for f in futs):
                peak = max(peak, redis_connections(u.jobs.proc.pid, srv.port))
                time.sleep(0.02)
            codes = {f.result().status_code for f in futs}
        assert codes == {503}, codes
        # 4 pooled + one blocking read per consumer (2) + the cancel listener
        assert 0 < peak <= 4 + 2 + 1, peak
        srv.resume()
        deadline = time.monotonic() + 15
        while u.api.get(f"/v1/jobs/{job_id}").status_code != 200:
            assert time.monotonic() < deadline, u.jobs.output()
            time.sleep(0.1)
        assert u.wait(u.submit("scripted", WORK, params={"tag": "after"})["id"])["state"] == "succeeded"
    finally:
        srv.resume()
        u.stop()
        srv.stop()


def test_a_full_redis_refuses_submits_with_503_and_the_unit_goes_on(tmp_path):
    """Redis at its maxmemory under noeviction (as the manifest runs it) refuses writes: a submit
    is a 503 in the envelope, what is stored still reads, and once memory is back jobs run."""
    import redis

    srv = RedisServer(tmp_path)
    u = Unit(tmp_path, "full", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             queue={"url": srv.url, "prefix": "full", "op_timeout_s": 2.0})
    admin = None
    try:
        srv.start()
        start_units(u)
        done = u.submit("scripted", WORK, params={"tag": "before"})["id"]
        assert u.wait(done)["state"] == "succeeded"
        running = u.submit("scripted", WORK, params={"tag": "long", "sleep_s": 3})["id"]
        u.wait(running, states={"running"})
        admin = redis.Redis(port=srv.port)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        for _ in range(3):
            r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "params": {"tag": "full"}},
                           timeout=30)
            assert r.status_code == 503, r.text
            err = error_of(r)
            assert err["code"] == "queue_full" and "maxmemory" in err["message"] and r.headers["retry-after"], r.text
        assert u.api.get(f"/v1/jobs/{done}").json()["state"] == "succeeded"
        # the unit says so: not ready, a metric, a log line
        ready = u.api.get("/readyz")
        assert ready.status_code == 503 and "refuses writes" in ready.json()["reason"], ready.text
        assert "onecard_jobs_queue_writable 0.0" in u.api.get("/metrics").text
        assert "Redis refuses writes (maxmemory" in u.jobs.output()
        # an accepted job still moves on: a cancel (it was a 500, then a 503) ends it
        r = u.api.delete(f"/v1/jobs/{running}", timeout=30)
        assert r.status_code == 202, r.text
        assert u.wait(running)["state"] == "cancelled"
        assert u.jobs.alive
        admin.config_set("maxmemory", 0)
        assert u.wait(u.submit("scripted", WORK, params={"tag": "after"})["id"])["state"] == "succeeded"
        assert u.api.get("/readyz").status_code == 200
        assert "onecard_jobs_queue_writable 1.0" in u.api.get("/metrics").text
    finally:
        if admin is not None:
            admin.close()
        u.stop()
        srv.stop()


# ---- start-up --------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, ""])
def test_a_queue_url_variable_that_is_missing_stops_the_start(tmp_path, value):
    env = {} if value is None else {"ONECARD_TEST_JOBS_QUEUE_URL": value}
    p = Proc("jobs", JOBS_APP, {"queue": {"url_env": "ONECARD_TEST_JOBS_QUEUE_URL"}}, tmp_path, env=env)
    if value is None:
        p.env.pop("ONECARD_TEST_JOBS_QUEUE_URL", None)
    p.start()
    try:
        code = p.proc.wait(timeout=60)
        out = p.output()
        assert code == 78, out
        assert "ONECARD_TEST_JOBS_QUEUE_URL" in out and "queue.url_env" in out, out
        assert "Traceback" not in out, out
    finally:
        p.kill()


def test_the_supervisor_stops_the_unit_with_78_when_the_queue_url_variable_is_missing(tmp_path):
    jobs = {"app": JOBS_APP, "port": free_port(), "threads": 1, "env": {"PYTHONPATH": str(ROOT)},
            "settings": {"queue": {"url_env": "ONECARD_TEST_JOBS_QUEUE_URL"}}}
    with SupervisorRun(tmp_path, {"jobs": jobs, "other": fake_service()}) as run:
        assert run.wait_exit(60) == 78
        out = run.output()
        assert "jobs: exited with code 78; stopping every service" in out, out
        assert "queue.url_env: the environment variable ONECARD_TEST_JOBS_QUEUE_URL is not set" in out, out
        assert not run.wait_no_leftovers()

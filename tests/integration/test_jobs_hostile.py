"""The jobs API against hostile clients: bodies nested deep or with numbers that are not
numbers, paths that try to leave their route, ids and keys that are not, control routes sent
as jobs, services without an OpenAPI document, an Idempotency-Key reused for another job,
results too large to keep, header floods and idle holders. Real processes and sockets;
every process is stopped by the test that started it."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.jobs_harness import IMG2IMG_APP, TARGET_APP, Unit, error_of, idempotency_rules, start_units

WORK = "/api/v1/work"


SCRIPTED = "scripted/scripted/m1"


BARE = "bare/scripted/m2"


MAX_RESULT = 200_000


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
    raw = '{"service": "scripted", "route": "/api/v1/work", "params": {"sleep_s": ' + number + "}}"
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


def test_a_submit_of_too_many_items_is_refused_as_it_arrives(unit):
    """A document of `[]` over max_json_items (10 000) is answered 413 json_too_complex from
    its first pieces: the client never has to send the rest (it was read whole and parsed in
    the helper process before: a stream of 30 MB ones held the probes 40 ms at p99)."""
    head = b'{"service": "scripted", "route": "/api/v1/work", "body": {"x": [' + b"[]," * 12_000
    with socket.create_connection(("127.0.0.1", unit.jobs.port), timeout=10) as s:
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 99000\r\n\r\n" + head)
        answer = b""
        while b"\r\n\r\n" not in answer or b"}}" not in answer:
            got = s.recv(65536)  # (a timeout here: the service waited for the rest of the body)
            if not got:
                break
            answer += got
    assert answer.startswith(b"HTTP/1.1 413") and b"json_too_complex" in answer, answer[:300]
    assert b"connection: close" in answer.lower()
    assert unit.api.get("/healthz").status_code == 200


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

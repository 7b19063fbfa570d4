"""The jobs service's pure parts: what a service's answer means, model labels, where the
targets are, settings, and the checks a submit goes through."""

from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from services.jobs.broker import ModelInfo
from services.jobs.payload import Limits, build_body
from services.jobs.payload import parse_envelope as parse_with_depth
from services.jobs.policy import RetryPolicy, Verdict, classify, retry_after_s
from services.jobs.records import public_view, request_digest, valid_id
from services.jobs.results import b64_length, inline_parts
from services.jobs.settings import JobsSettings, redact, valid_route
from services.jobs.targets import job_routes, model_label, unit_services
from services.runtime.errors import ApiError
from services.runtime.settings import StartupConfigError
from tests.images import pixel_bomb_png, small_png


@pytest.mark.parametrize("status,code,verdict", [
    (200, None, Verdict.SUCCEEDED), (201, None, Verdict.SUCCEEDED),
    (503, "overloaded", Verdict.BACKPRESSURE), (503, "not_ready", Verdict.BACKPRESSURE),
    (429, "slow_down", Verdict.BACKPRESSURE),
    (503, "out_of_memory", Verdict.ATTEMPT_FAILED), (500, "internal_error", Verdict.ATTEMPT_FAILED),
    (502, None, Verdict.ATTEMPT_FAILED), (504, "deadline_exceeded", Verdict.ATTEMPT_FAILED),
    (400, "corrupt_image", Verdict.REJECTED), (413, "too_many_pixels", Verdict.REJECTED),
    (422, "invalid_parameter", Verdict.REJECTED), (404, "not_found", Verdict.REJECTED),
])
def test_what_an_answer_means(status, code, verdict):
    assert classify(status, code) is verdict


@pytest.mark.parametrize("header,expected", [
    ("2", 2.0), ("0.25", 0.25), (None, 1.0), ("soon", 1.0), ("0", 0.05), ("99999", 30.0), ("nan", 1.0),
])
def test_retry_after_is_read_and_clamped(header, expected):
    assert retry_after_s(header, 1.0) == expected


def test_backoff_doubles_up_to_its_cap_with_jitter_below_it():
    draws = iter([0.0, 0.0, 0.0, 0.0, 1.0, 0.5])
    p = RetryPolicy(max_attempts=10, backoff_s=1.0, backoff_max_s=5.0, jitter=0.5, rng=lambda: next(draws, 0.0))
    assert [p.backoff(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert p.backoff(1) == 0.5 and p.backoff(3) == 3.0  # drawn from [d * (1 - jitter), d]
    assert p.after_run(2, charged=True).action == "retry" and p.after_run(9, charged=True).action == "dead"
    assert p.after_run(9, charged=False) == p.after_run(9, charged=False)
    assert p.after_run(9, charged=False).action == "retry" and p.after_run(9, charged=False).attempts == 9
    assert RetryPolicy(backoff_s=0).backoff(3) == 0.0


def test_model_label_reported_derived_or_overridden():
    assert model_label("img2img", {"model_label": "img2img/diffusers/sd15", "backend": "x"}) == "img2img/diffusers/sd15"
    assert model_label("detect", {"backend": "centerface", "model": "/opt/m/centerface.onnx"}) == \
        "detect/centerface/centerface.onnx"
    assert model_label("img2img", {"backend": "diffusers", "model": "/models/sd-1.5/"}) == "img2img/diffusers/sd-1.5"
    assert model_label("detect", {"backend": "haar", "model": None}) == "detect/haar/default"
    assert model_label("detect", {"backend": "a b", "model": "x y"}) == "detect/a_b/x_y"
    assert model_label("detect", {"model_label": "not a label"}) == "detect/default/default"
    assert model_label("detect", {"model_label": "detect/a/b"}, override="detect/mine/v2") == "detect/mine/v2"


def test_job_routes_are_post_routes_with_a_json_body():
    body = {"requestBody": {"content": {"application/json": {}, "image/png": {}}}}
    doc = {"paths": {"/api/v1/img2img": {"post": body}, "/sdapi/v1/progress": {"get": {}},
                     "/sdapi/v1/img2img": {"post": {"requestBody": {"content": {"application/json": {}}}}},
                     "/sdapi/v1/interrupt": {"post": {}}, "/sdapi/v1/options": {"get": {}, "post": {}},
                     "/upload": {"post": {"requestBody": {"content": {"multipart/form-data": {}}}}},
                     "/a/../b": {"post": body}, "/a/{id}": {"post": body}, "/x\n": {"post": body},
                     "/weird": {"post": {"requestBody": "nope"}}, "/odd": "nope"}}
    assert job_routes(doc) == (["/api/v1/img2img", "/sdapi/v1/img2img"],
                               ["/sdapi/v1/interrupt", "/sdapi/v1/options", "/upload", "/weird"])
    assert job_routes({"paths": []}) == ([], []) and job_routes({}) == ([], [])


@pytest.mark.parametrize("route,ok", [
    ("/api/v1/img2img", True), ("/a.b/c-d_e", True), ("/a/.../b", False), ("/a/./b", False), ("/a/../b", False),
    ("/a/.", False), ("/a\n", False), ("/a\r\n", False), ("/a/", False), ("a", False), ("//a", False),
    ("/a b", False), ("/\u00e9", False), ("/a%2e", False), ("", False), ("/" + "a" * 256, False)])
def test_routes_are_plain_paths(route, ok):
    assert valid_route(route) is ok


def test_ids_are_exactly_32_hex_digits():
    assert valid_id("0123456789abcdef" * 2)
    for bad in ("0123456789abcdef" * 2 + "\n", "A" * 32, "\u0661" * 32, "0" * 31, "0" * 33, ""):
        assert not valid_id(bad), bad


def test_the_idempotency_digest_covers_service_route_model_and_body():
    base = request_digest("img2img", "/r", "img2img/a/b", "0" * 64)
    assert base == request_digest("img2img", "/r", "img2img/a/b", "0" * 64)
    others = {request_digest("detect", "/r", "img2img/a/b", "0" * 64), request_digest("img2img", "/s", "img2img/a/b",
              "0" * 64), request_digest("img2img", "/r", "img2img/a/c", "0" * 64),
              request_digest("img2img", "/r", "img2img/a/b", "1" * 64)}
    assert base not in others and len(others) == 4


def test_targets_come_from_the_unit_then_from_the_settings():
    settings = JobsSettings.model_validate({"targets": {
        "detect": "http://127.0.0.1:7862", "img2img": {"url": "http://127.0.0.1:7861", "model_label": "img2img/x/y"}}})
    env = {"ONECARD_UNIT_SERVICES": json.dumps({"img2img": {"url": "http://10.0.0.5:9001/"},
                                                "jobs": {"url": "http://127.0.0.1:7863"}})}
    got = unit_services(settings, "jobs", env)
    assert list(got) == ["img2img"]  # the unit's list wins; the jobs service is not its own target
    assert got["img2img"].url == "http://10.0.0.5:9001" and got["img2img"].model_label == "img2img/x/y"
    got = unit_services(settings, "jobs", {})
    assert {n: t.url for n, t in got.items()} == {"detect": "http://127.0.0.1:7862", "img2img": "http://127.0.0.1:7861"}
    with pytest.raises(ValueError):
        unit_services(settings, "jobs", {"ONECARD_UNIT_SERVICES": "{nope"})


@pytest.mark.parametrize("section,fragment", [
    ({"queue": {"url": "http://redis:6379"}}, "redis://"),
    ({"queue": {"visibility_timeout_s": 0}}, "visibility_timeout_s"),
    ({"queue": {"max_attempts": 0}}, "max_attempts"),
    ({"queue": {"bogus": 1}}, "bogus"),
    ({"targets": {"detect": "not a url"}}, "http://host:port"),
    ({"targets": {"detect": {"url": "http://x:1", "model_label": "nope"}}}, "service/backend/model"),
    ({"accept_models": ["x"]}, "service/backend/model"),
    ({"default_models": {"detect": "img2img/a/b"}}, "default_models.detect"),
    ({"max_queued_jobs": 0}, "max_queued_jobs"),
    ({"queue": {"op_timeout_s": 0}}, "op_timeout_s"),
    ({"queue": {"max_connections": 0}}, "max_connections"),
    ({"queue": {"max_finished_jobs": 0}}, "max_finished_jobs"),
    ({"max_json_depth": 2}, "max_json_depth"),
    ({"max_result_bytes": 10}, "max_result_bytes"),
    ({"max_result_bytes": 4096, "queue": {"max_results_bytes": 2048}}, "max_results_bytes"),
    ({"targets": {"x": {"url": "http://x:1", "routes": ["/a/../b"]}}}, "/a/../b"),
    ({"targets": {"x": {"url": "http://x:1", "routes": ["/a\n"]}}}, "expected a path"),
    ({"accept_models": ["a/b/c\n"]}, "service/backend/model"),
    ({"targets": {"detect": "http://x:1\n"}}, "http://host:port"),
])
def test_bad_settings_are_refused(section, fragment):
    with pytest.raises(ValidationError) as err:
        JobsSettings.model_validate(section)
    assert fragment in str(err.value)


def test_default_settings_are_embedded_and_sane():
    s = JobsSettings.model_validate({})
    assert s.queue.resolved_url() is None and s.queue.max_attempts == 3 and s.consume
    assert (s.queue.op_timeout_s, s.queue.max_connections, s.queue.max_finished_jobs) == (5.0, 64, 100_000)
    assert (s.queue.max_results_bytes, s.queue.max_queued_bytes) == (2**30, 2**30)
    assert (s.max_result_bytes, s.max_json_depth) == (128 * 2**20, 33)


def test_the_embedded_store_is_sized_from_the_services_memory_budget(caplog):
    """Left at their defaults (1 GiB each), the embedded queue's bodies and results fit in 60 %
    of the jobs service's planned memory less what submits being read may hold; set in the
    configuration they are kept (with a warning); with room enough, or no budget known,
    nothing changes."""
    from services.jobs.store_budget import EMBEDDED_STORE_SHARE, sized_for_memory
    budget = 1638 * 2**20
    plan = {"ONECARD_MEMORY_BUDGET_BYTES": str(budget)}
    s = JobsSettings.model_validate({})
    q = sized_for_memory(s, plan)
    assert q.max_queued_bytes + q.max_results_bytes <= budget * EMBEDDED_STORE_SHARE - s.submit_memory_bytes
    assert q.max_results_bytes >= s.max_result_bytes and q.max_queued_bytes >= s.max_body_bytes
    assert (q.max_attempts, q.results_ttl_s) == (s.queue.max_attempts, s.queue.results_ttl_s)
    explicit = JobsSettings.model_validate({"queue": {"max_results_bytes": 2**30, "max_queued_bytes": 2**30}})
    assert sized_for_memory(explicit, plan) == explicit.queue and "as configured" in caplog.text
    one = JobsSettings.model_validate({"queue": {"max_results_bytes": 300 * 2**20}})
    q = sized_for_memory(one, plan)  # the other fills what is left
    assert q.max_results_bytes == 300 * 2**20
    assert q.max_queued_bytes + q.max_results_bytes <= budget * EMBEDDED_STORE_SHARE - s.submit_memory_bytes
    caplog.clear()
    tiny = sized_for_memory(s, {"ONECARD_MEMORY_BUDGET_BYTES": str(256 * 2**20)})  # less than the submits' room
    assert (tiny.max_results_bytes, tiny.max_queued_bytes) == (s.max_result_bytes, s.max_body_bytes)
    assert "its smallest" in caplog.text
    assert sized_for_memory(s, {"ONECARD_MEMORY_BUDGET_BYTES": str(64 * 2**30)}) is s.queue
    assert sized_for_memory(s, {}, limit=0) is s.queue  # no budget known: no change


def test_a_queue_url_variable_must_name_a_url():
    s = JobsSettings.model_validate({"queue": {"url_env": "JOBS_TEST_REDIS_URL"}})
    for env in ({}, {"JOBS_TEST_REDIS_URL": ""}, {"JOBS_TEST_REDIS_URL": "  "}, {"JOBS_TEST_REDIS_URL": "http://x"}):
        with pytest.raises(StartupConfigError) as err:
            s.queue.resolved_url(env)
        assert "queue.url_env" in str(err.value) and "JOBS_TEST_REDIS_URL" in str(err.value)
    assert s.queue.resolved_url({"JOBS_TEST_REDIS_URL": "redis://r:6379/0"}) == "redis://r:6379/0"


@pytest.mark.parametrize("url", ["redis://:pa/ss@h:6379/0", "redis://:12/34@h:6379/0", "redis://u:p?w@h:6379/0",
                                 "redis://:p#w@h/0", "redis://:secret@h:notaport/0", "redis:///0"])
def test_a_redis_url_that_does_not_parse_is_refused_without_quoting_it(url):
    """An unencoded '/', '?' or '#' in a password: redis-py would fail on a piece of it as a
    port (printing it) or quietly connect to localhost."""
    s = JobsSettings.model_validate({"queue": {"url_env": "JOBS_TEST_REDIS_URL"}})
    with pytest.raises(StartupConfigError) as err:
        s.queue.resolved_url({"JOBS_TEST_REDIS_URL": url})
    assert "percent-encode" in str(err.value)
    with pytest.raises(ValidationError) as bad:
        JobsSettings.model_validate({"queue": {"url": url}})
    assert "percent-encode" in str(bad.value)
    for secret in ("pa/ss", "12/34", "p?w", "p#w", "secret"):
        assert secret not in str(err.value)
    for good in ("redis://:pa%2Fss@h:6379/0", "rediss://u:p@h:6380/1", "redis://h/0", "unix:///run/redis.sock"):
        assert s.queue.resolved_url({"JOBS_TEST_REDIS_URL": good}) == good


@pytest.mark.parametrize("url, shown", [("redis://:pa/ss@h:6379/0", "redis://:***@h:6379/0"),
                                        ("redis://u:p@w@h:6379/0", "redis://u:***@h:6379/0"),
                                        ("redis://h:6379/0", "redis://h:6379/0"),
                                        ("redis://default@h:6379/0", "redis://default@h:6379/0")])
def test_the_queue_url_shown_in_info_never_holds_its_password(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize("limits", ["x", [1], 5, {"max_body_bytes": "big", "max_pixels": True},
                                    {"max_pixels": float("inf"), "max_body_bytes": float("nan")}])
def test_a_malformed_model_entry_in_the_queue_has_no_limits_rather_than_breaking_submits(limits):
    info = ModelInfo.from_json({"label": "a/b/c", "service": "a", "routes": ["/r"], "limits": limits})
    assert info.limits == {} and info.routes == ["/r"]
    assert ModelInfo.from_json({"label": "a/b/c", "service": "a", "limits": {"max_pixels": 10}}).limits == \
        {"max_pixels": 10}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


LIMITS = Limits(max_image_bytes=10_000, max_pixels=1_000_000, max_body_bytes=None)


def parse_envelope(raw: bytes):
    return parse_with_depth(raw, 8)


def _err(fn, *args) -> tuple[int, str]:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value.status, e.value.code


def test_envelope_checks():
    assert _err(parse_envelope, b"\xff") == (400, "bad_json")
    assert _err(parse_envelope, b"[1]") == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "Detect!", "route": "/a"}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "detect", "route": "/a/../b"}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "detect", "route": "/a?x=1"}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "detect", "route": "/a/./b"}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "detect", "route": "/a\\n"}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "detect\\n", "route": "/a"}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "d", "route": "/a", "body": {"x": NaN}}') == (422, "invalid_parameter")
    assert _err(parse_envelope, b'{"service": "d", "route": "/a", "body": {"x": 1e999}}') == (422, "invalid_parameter")
    deep = b'{"service": "d", "route": "/a", "body": {"x": ' + b"[" * 7 + b"]" * 7 + b"}}"
    assert _err(parse_envelope, deep) == (400, "json_too_deep")
    assert _err(parse_envelope, b"[" * 100_000) == (400, "json_too_deep")
    assert parse_envelope(deep.replace(b"[" * 7, b"[" * 6).replace(b"]" * 7, b"]" * 6)).body == {"x": [[[[[[]]]]]]}
    req = parse_envelope(b'{"service": "detect", "route": "/api/v1/facedetect", "params": {"min_score": 0.2}}')
    assert req.service == "detect" and req.params == {"min_score": 0.2}


def test_body_for_the_service_and_its_image_checks():
    img = _b64(small_png())
    req = parse_envelope(json.dumps({"service": "d", "route": "/r", "params": {"k": 1}, "image": img}).encode())
    body, sha = build_body(req, LIMITS)
    assert json.loads(body) == {"k": 1, "image": img} and len(sha) == 64
    req = parse_envelope(json.dumps({"service": "d", "route": "/r", "body": {
        "init_images": ["data:image/png;base64," + img, "!!"]}}).encode())
    assert _err(build_body, req, LIMITS) == (400, "bad_base64")  # the second image of the list
    for image, expected in (([], (422, "invalid_parameter")), ("", (400, "empty_image")),
                            (_b64(pixel_bomb_png(2000, 2000)), (413, "too_many_pixels")),
                            (_b64(b"GIF89a" + b"\0" * 20), (415, "unsupported_image")),
                            (_b64(small_png() + b"\0" * 10_000), (413, "image_too_large")),
                            (_b64(b"\x89PNG\r\n\x1a\n" + b"\0" * 30), (400, "corrupt_image"))):
        req = parse_envelope(json.dumps({"service": "d", "route": "/r", "body": {"image": image}}).encode())
        assert _err(build_body, req, LIMITS) == expected, image[:20]
    req = parse_envelope(json.dumps({"service": "d", "route": "/r", "body": {"image": img, "pad": "x" * 500}}).encode())
    assert _err(build_body, req, Limits(10_000, 1_000_000, max_body_bytes=400)) == (413, "body_too_large")


def test_public_view_and_inline_results():
    view = public_view({"id": "a" * 32, "state": "failed", "attempts": "3",
                        "error": json.dumps({"code": "kaput", "message": "m"}), "cancel": "1"})
    assert view["state"] == "failed" and view["attempts"] == 3 and view["progress"] == 1.0
    assert view["error"]["code"] == "kaput" and view["cancel_requested"] is True
    assert public_view({"id": "b" * 32, "state": "queued"})["progress"] == 0.0

    def inline(data: bytes, **fields) -> dict:
        view = {"id": "c" * 32, "state": "succeeded"}
        head, tail, encode = inline_parts(view, fields, len(data))
        doc = json.loads(head + (base64.b64encode(data) if encode else data) + tail)
        assert doc["id"] == "c" * 32 and b64_length(len(data)) == len(base64.b64encode(data))
        return doc["result"]
    assert inline(b'{"faces": []}', result_type="application/json", result_json="1") == {"faces": []}
    assert inline(b"\x89PNG", result_type="image/png", result_headers='{"x-seed": "7"}') == \
        {"content_type": "image/png", "image": _b64(b"\x89PNG"), "seed": "7"}
    assert inline(b"abc", result_type="application/octet-stream")["data"] == _b64(b"abc")
    assert inline(b'{"not": json', result_type="application/json", result_json="0")["data"] == \
        _b64(b'{"not": json')  # a service that said JSON and sent something else
    assert inline(b"", result_type="text/plain") == {"content_type": "text/plain", "data": ""}
    assert json.loads(inline_parts({"id": "d" * 32}, {}, None)[0]) == {"id": "d" * 32, "result": None}


def test_lua_scripts_take_their_keys_and_arguments_by_name_only():
    from services.jobs.redis_scripts import SCRIPTS
    script = SCRIPTS["SOLO"]
    assert script.bind({"job": "P:job:x"}, {"lease": "abc"}) == (["P:job:x"], ["abc"])
    assert script.source.startswith("#!lua flags=allow-oom\n") and "local K = {job = KEYS[1]}" in script.source
    for keys, args in (({}, {"lease": "a"}), ({"job": "j"}, {}), ({"job": "j", "body": "b"}, {"lease": "a"}),
                       ({"job": "j"}, {"lease": "a", "attempts": 3})):
        with pytest.raises(ValueError):
            script.bind(keys, args)
    with pytest.raises(ValueError):
        script.bind({"job": "j"}, {"lease": "a"}, extra_keys=["k"])  # not a variadic script
    assert SCRIPTS["SUBMIT"].denies_oom and SCRIPTS["REDRIVE"].denies_oom  # they add work: a full Redis refuses them
    assert not any(s.denies_oom for name, s in SCRIPTS.items() if name not in ("SUBMIT", "REDRIVE"))


def test_the_default_body_limit_fits_one_largest_picture_and_little_else():
    """A submit body past one max_image_bytes picture in base64 (and some room for the rest)
    could never pass the image check: it is refused by its declared length, before it is read
    (200 such 30 MB bodies read whole took the two cores from every service's probes)."""
    s = JobsSettings()
    one_picture = -(-s.max_image_bytes // 3) * 4
    assert one_picture + 1024 * 1024 <= s.max_body_bytes <= one_picture + 2 * 1024 * 1024
    assert s.max_body_bytes < 30_000_000  # the 30 MB submits


def test_a_big_page_of_jobs_is_made_off_the_event_loop(monkeypatch):
    """GET /v1/jobs: a page of 500 job views (half a megabyte of JSON) is built and encoded on
    the service's executor, not on the loop that answers /healthz; a small page stays on the
    loop (a thread hop would cost it more). The answer is the same either way."""
    import concurrent.futures
    import threading

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from services.jobs import api_admin, views
    from services.jobs.service import JobsService

    threads: dict[str, set] = {"loop": set(), "views": set()}
    real_view = views.public_view
    monkeypatch.setattr(views, "public_view",
                        lambda f: threads["views"].add(threading.get_ident()) or real_view(f))

    class Broker:
        async def list_jobs(self, model, state, limit, cursor):
            threads["loop"].add(threading.get_ident())
            return [{"id": f"{i:032x}", "state": state, "model": model} for i in range(limit)], None

    class Svc:
        broker = Broker()
        executor = concurrent.futures.ThreadPoolExecutor(1)
        settings = JobsSettings.model_validate({})
        cpu = JobsService.cpu

    svc = Svc()
    app = FastAPI()
    api_admin.add_admin_routes(app, svc)
    try:
        with TestClient(app) as client:
            for limit, off_loop in ((500, True), (8, False)):
                threads["views"].clear()
                r = client.get("/v1/jobs", params={"model": "detect/haar/haar", "state": "queued", "limit": limit})
                assert r.status_code == 200 and len(r.json()["jobs"]) == limit
                assert r.json()["jobs"][0]["id"] == f"{0:032x}" and r.json()["next_cursor"] is None
                assert bool(threads["views"] - threads["loop"]) == off_loop, (limit, threads)
    finally:
        svc.executor.shutdown()



@pytest.mark.parametrize("cost, reserve", [({"output_bytes": None}, None), ({}, None), ({"output_bytes": True}, None),
                                           ({"output_bytes": 1e400}, None), ({"output_bytes": 5000}, 5000)])
def test_a_dry_run_that_does_not_say_what_its_answer_weighs_leaves_the_reserve_to_the_setting(cost, reserve):
    from services.jobs.targets import output_bytes
    assert output_bytes({"valid": True, "cost": cost}) == reserve

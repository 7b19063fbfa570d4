"""Each service's /metrics is a valid Prometheus exposition with the families operators
rely on: parsed by prometheus_client's parser with our own lint rules, and checked by
`promtool check metrics` (Debian's `prometheus`, which ./dev.sh installs: a missing
promtool fails these tests, it never skips them)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import SupervisorRun, fake_service
from tests.images import small_png
from tests.jobs_harness import TARGET_APP, Unit, start_units
from tests.prometheus_server import promtool
from tests.service_harness import ServiceProcess

SERVICES = {
    "detect": ("services.detect.app:create_app", {"max_side": 128, "device": "cpu"}, "/api/v1/facedetect"),
    "img2img": ("services.img2img.app:create_app", {"max_side": 128, "device": "cpu"}, "/api/v1/img2img"),
}


@pytest.fixture(scope="module", params=sorted(SERVICES))
def exposition(request, tmp_path_factory):
    app, settings, route = SERVICES[request.param]
    with ServiceProcess(app, settings, tmp_path_factory.mktemp(request.param)) as svc:
        png = {"content-type": "image/png"}
        assert httpx.post(svc.url + route, content=small_png(), headers=png, timeout=60).status_code == 200
        assert httpx.post(svc.url + route, content=b"junk", headers=png, timeout=60).status_code == 415
        httpx.get(svc.url + "/info")
        yield request.param, route, httpx.get(svc.url + "/metrics").text


def lint(text: str) -> list[str]:
    problems = []
    helps, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            if name in helps:
                problems.append(f"HELP twice for {name}")
            helps[name] = True
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if name in types:
                problems.append(f"TYPE twice for {name}")
            types[name] = kind
    for name, kind in types.items():
        if kind == "counter" and not name.endswith("_total") and f"{name}_total" not in text:
            problems.append(f"counter {name} has no _total samples")
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            by_labels: dict[tuple, list[tuple[float, float]]] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    by_labels.setdefault(key, []).append((float(s.labels["le"]), s.value))
            for key, buckets in by_labels.items():
                buckets.sort()
                if buckets[-1][0] != float("inf"):
                    problems.append(f"{family.name}{key}: no +Inf bucket")
                if any(b[1] > c[1] for b, c in zip(buckets, buckets[1:], strict=False)):
                    problems.append(f"{family.name}{key}: buckets not cumulative")
    return problems


def test_the_exposition_parses_cleanly_and_has_the_operator_families(exposition):
    name, route, text = exposition
    assert lint(text) == []
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for needed in ("onecard_requests", "onecard_request_duration_seconds", "onecard_stage_seconds",
                   "onecard_batch_size", "onecard_queue_depth", "onecard_in_flight", "onecard_dropped",
                   "onecard_build_info", "onecard_connections_refused"):
        assert needed in families, needed
    lat = families["onecard_request_duration_seconds"]
    buckets = {float(s.labels["le"]) for s in lat.samples if s.name.endswith("_bucket")}
    assert max(b for b in buckets if b != float("inf")) >= 600  # img2img calls may take minutes
    routes = {(s.labels["route"], s.labels["status"]) for s in lat.samples if s.name.endswith("_count")}
    assert {(route, "200"), (route, "415"), ("/info", "200")} <= routes
    stages = {s.labels["stage"] for s in families["onecard_stage_seconds"].samples if s.labels.get("route") == route}
    assert stages == {"decode", "queue", "infer", "encode"}
    build = [s for s in families["onecard_build_info"].samples]
    assert build and build[0].value == 1 and build[0].labels["service"]


def test_promtool_accepts_the_exposition(exposition):
    _, _, text = exposition
    r = promtool("check", "metrics", input=text, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_supervisor_and_jobs_expositions_are_clean_too(tmp_path):
    """The other two kinds of target a unit has: the supervisor's probe port, the jobs service."""
    texts = {}
    with SupervisorRun(tmp_path, {"a": fake_service()}) as run:
        run.wait_ready()
        texts["supervisor"] = httpx.get(f"http://127.0.0.1:{run.health_port}/metrics").text
    unit = Unit(tmp_path, "lint", targets={"scripted": (TARGET_APP, {"model": "m1"})})
    try:
        start_units(unit)
        unit.submit("scripted", "/api/v1/work", body={"tag": "lint"})
        texts["jobs"] = unit.api.get("/metrics").text
    finally:
        unit.stop()
    for name, text in texts.items():
        assert lint(text) == [], name
        r = promtool("check", "metrics", input=text, timeout=30)
        assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"
    assert "onecard_ready" in texts["supervisor"] and "onecard_jobs_stream_lag" in texts["jobs"]


# ---- the OpenAPI document ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SERVICES))
def test_the_openapi_document_is_valid_and_describes_inputs_outputs_errors_and_auth(name, tmp_path):
    from openapi_spec_validator import validate
    app, settings, route = SERVICES[name]
    with ServiceProcess(app, {**settings, "api_key_env": "K"}, tmp_path, env={"K": "secret"}) as svc:
        doc = httpx.get(svc.url + "/openapi.json").json()
        validate(doc)
        op = doc["paths"][route]["post"]
        assert op["parameters"] and all(p["in"] == "query" and "schema" in p for p in op["parameters"])
        assert {"image/jpeg", "application/json", "multipart/form-data"} <= set(op["requestBody"]["content"])
        assert op["responses"]["200"]["content"]
        for status in ("400", "401", "413", "415", "422", "503", "504"):
            schema = op["responses"][status]["content"]["application/json"]["schema"]
            assert schema["required"] == ["error"]
        info = doc["paths"]["/info"]["get"]["responses"]
        assert {"200", "401", "500"} <= set(info)
        assert set(doc["components"]["securitySchemes"]) == {"apiKey", "bearer"} and doc["security"]
        page = httpx.get(svc.url + "/docs")
        assert page.status_code == 200 and "/docs/swagger-ui-bundle.js" in page.text
        js = httpx.get(svc.url + "/docs/swagger-ui-bundle.js")
        assert js.status_code == 200 and len(js.content) > 100_000  # served from the wheel: no CDN

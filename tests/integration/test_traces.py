"""Traces across real processes: a unit (the supervisor, the jobs service and a model
service written with the public API) configured with the standard OTEL_* variables sends
its spans to an OTLP/HTTP receiver this test runs (tests/otlp_receiver.py), and one job's
trace holds the client's call, the submit, the queue wait, the attempt and the service's
request span with its stages, with the right parents. Without OTEL_* a service imports
nothing of the OpenTelemetry SDK, exporter or protobuf messages (FastAPI itself imports
opentelemetry-api, a requirement of its own since its native telemetry); configured
without the SDK, it warns once and serves."""

from __future__ import annotations

import os
import time

import httpx

from onecard.testing import ServiceProcess, picture
from tests.harness import ROOT, SupervisorRun, free_port
from tests.jobs_harness import b64
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

APP = "tests.children.sdk_app:create_app"
# what onecard[otel] brings and a service without traces never imports
OTEL_EXTRA = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, INTERNAL = 2, 1  # OTLP's SpanKind numbers
STAGES = ("decode", "queue", "infer", "encode")


def _without_otel(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("OTEL_")}


def _one(spans: list[ReceivedSpan], **match) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name, s.span_id, s.parent_id) for s in spans])
    return found[0]


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id]


def test_a_jobs_trace_runs_from_the_client_through_the_attempt_into_the_service(tmp_path):
    with OtlpReceiver() as receiver:
        ports = {"tint": free_port(), "jobs": free_port()}
        services = {
            "tint": {"app": APP, "port": ports["tint"], "threads": 1, "env": {"PYTHONPATH": str(ROOT)},
                     "settings": {"warmup_runs": 1}},
            "jobs": {"app": "services.jobs.app:create_app", "port": ports["jobs"], "threads": 1, "settings": {}},
        }
        env = {**_without_otel(os.environ), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
        run = SupervisorRun(tmp_path, services, env=env, startup_timeout_s=120.0)
        try:
            run.start()
            run.wait_ready(timeout=150)
            jobs = f"http://127.0.0.1:{ports['jobs']}"
            r = httpx.post(jobs + "/v1/jobs", json={"service": "tint", "route": "/api/v1/tint",
                                                    "params": {"tag": "traced"}, "image": b64(picture(16, 16))},
                           headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, timeout=30)
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            deadline = time.monotonic() + 60
            while (doc := httpx.get(f"{jobs}/v1/jobs/{job_id}", timeout=10).json())["state"] in ("queued", "running"):
                assert time.monotonic() < deadline, doc
                time.sleep(0.05)
            assert doc["state"] == "succeeded", doc

            def complete(spans: list[ReceivedSpan]) -> bool:
                mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
                names = {s.name for s in mine}
                return {"job attempt", "job queue wait", "job submit", "POST /v1/jobs"} <= names and \
                    sum(s.name == "encode" for s in mine) >= 1
            spans = [s for s in receiver.wait_for(complete, 60, "the job's trace") if s.trace_id == CLIENT_TRACE]
            # the tint service's modules, while traces are on: the negative test below is not vacuous
            loaded = httpx.get(f"http://127.0.0.1:{ports['tint']}/modules", params={"prefix": "opentelemetry"}).json()
            assert "opentelemetry.sdk.trace" in loaded
        finally:
            run.stop()

    request = _one(spans, name="POST /v1/jobs")
    assert request.parent_id == CLIENT_SPAN and request.kind == SERVER  # the client's traceparent is its parent
    assert request.attributes["http.response.status_code"] == 202 and request.attributes["http.route"] == "/v1/jobs"
    assert request.resource["service.name"] == "onecard-jobs" and request.resource["onecard.service"] == "jobs"
    assert request.resource["onecard.unit"] and request.resource["deployment.environment"] == "test"

    submit = _one(spans, name="job submit")
    assert submit.parent_id == request.span_id
    assert submit.attributes["onecard.job.id"] == job_id and submit.attributes["onecard.job.service"] == "tint"

    wait = _one(spans, name="job queue wait")
    attempt = _one(spans, name="job attempt")
    assert wait.parent_id == submit.span_id and attempt.parent_id == submit.span_id
    assert wait.end_ns <= attempt.start_ns + 50_000_000 and wait.start_ns >= submit.start_ns
    assert attempt.attributes["onecard.job.attempt"] == 1 and attempt.attributes["onecard.job.outcome"] == "succeeded"
    assert attempt.attributes["onecard.job.id"] == job_id and attempt.status != 2

    # the service's request span: a child of the attempt (the dry run's, if any, a child of the submit)
    call = _one(spans, name="POST /api/v1/tint", parent_id=attempt.span_id)
    assert call.kind == SERVER and call.attributes["http.response.status_code"] == 200
    assert call.resource["service.name"] == "onecard-tint" and call.resource["onecard.service"] == "tint"
    for other in (s for s in spans if s.name == "POST /api/v1/tint" and s is not call):
        assert other.parent_id == submit.span_id and other.attributes["http.response.status_code"] == 200
    stages = {s.name: s for s in _children(spans, call)}
    assert set(stages) == set(STAGES), stages
    for stage in stages.values():
        assert call.start_ns <= stage.start_ns <= stage.end_ns <= call.end_ns
        assert stage.kind == INTERNAL
    assert stages["infer"].attributes["onecard.batch.size"] == 1
    assert stages["decode"].end_ns <= stages["queue"].start_ns + 1_000_000  # in the pipeline's order
    assert stages["queue"].end_ns <= stages["infer"].start_ns + 1_000_000


def test_without_otel_variables_a_service_imports_nothing_of_opentelemetry():
    svc = ServiceProcess(APP, {"warmup_runs": 1}, name="tint")
    svc.env = _without_otel(svc.env)  # whatever the machine running the tests has set
    with svc:
        r = svc.post_image("/api/v1/tint", picture(16, 16))
        assert r.status_code == 200
        for prefix in OTEL_EXTRA:
            assert svc.get("/modules", params={"prefix": prefix}).json() == [], prefix
        assert svc.get("/modules", params={"prefix": "services.runtime.traces"}).json() == [
            "services.runtime.traces", "services.runtime.traces.config", "services.runtime.traces.setup",
            "services.runtime.traces.stages"]


def test_configured_without_the_sdk_a_service_warns_once_and_serves(tmp_path):
    absent = tmp_path / "absent"
    # opentelemetry is a namespace package: this portion comes first on the path and its SDK
    # fails to import, as where onecard[otel] is not installed
    (absent / "opentelemetry" / "sdk").mkdir(parents=True)
    (absent / "opentelemetry" / "sdk" / "__init__.py").write_text('raise ImportError("injected: not installed")\n')
    svc = ServiceProcess(APP, {"warmup_runs": 1}, name="tint", pythonpath=[absent, ROOT])
    svc.env = {**_without_otel(svc.env), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    with svc:
        for _ in range(3):
            assert svc.post_image("/api/v1/tint", picture(16, 16)).status_code == 200
        for prefix in OTEL_EXTRA:
            assert svc.get("/modules", params={"prefix": prefix}).json() == [], prefix
        warnings = [line for line in svc.output().splitlines() if "OpenTelemetry is not installed" in line]
        assert len(warnings) == 1 and "onecard[otel]" in warnings[0], svc.output()

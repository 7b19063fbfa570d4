"""Traces in-process: the span tree of one request through the real pipeline (a service
written with the public API, tests/children/sdk_app.py, on an in-memory exporter), what
turns traces on, the resource, and what a service looks like with traces off. Across
processes, with OTLP: tests/integration/test_traces.py and test_traces_jobs.py."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import services.runtime.shell.app as shell_app
from onecard.testing import picture
from services.runtime.traces.config import traces_wanted
from services.runtime.traces.middleware import TraceMiddleware
from services.runtime.traces.setup import traces_from_environment
from services.runtime.traces.tracer import Traces, exporters_from_environment, resource_for
from tests.children.sdk_app import create_app

TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
PNG = {"content-type": "image/png"}


@pytest.fixture
def traced(monkeypatch):
    """The sdk service with its spans in memory (the shell asks this factory for its Traces)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(shell_app, "traces_from_environment", lambda name, version="": Traces(provider, version))

    def make(**settings) -> TestClient:
        return TestClient(create_app({"warmup_runs": 1, **settings}), raise_server_exceptions=False)
    make.exporter = exporter
    return make


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def _requests(exporter: InMemorySpanExporter) -> list:
    return [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]


def _children(exporter: InMemorySpanExporter, parent) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id}


def test_a_request_span_is_the_callers_child_with_the_pipelines_stages_as_its_children(traced):
    with traced() as c:
        r = c.post("/api/v1/tint", content=picture(16, 16), headers={
            **PNG, "traceparent": f"00-{TRACE}-{CALLER}-01", "tracestate": "vendor=1"})
        assert r.status_code == 200
    (span,) = _requests(traced.exporter)
    assert span.name == "POST /api/v1/tint"
    assert _hex(span.context.trace_id, 32) == TRACE and _hex(span.parent.span_id, 16) == CALLER
    assert span.parent.is_remote and span.context.trace_state.get("vendor") == "1"
    assert span.attributes["http.route"] == "/api/v1/tint" and span.attributes["http.request.method"] == "POST"
    assert span.attributes["http.response.status_code"] == 200 and span.status.status_code == StatusCode.UNSET
    stages = _children(traced.exporter, span)
    assert set(stages) == {"decode", "queue", "infer", "encode"}
    for stage in stages.values():
        assert span.start_time <= stage.start_time <= stage.end_time <= span.end_time
        assert stage.context.trace_id == span.context.trace_id
    assert stages["infer"].attributes["onecard.batch.size"] == 1
    # the stages as Server-Timing says them, in the pipeline's order
    assert [k.split(";")[0] for k in r.headers["server-timing"].split(", ")] == ["decode", "queue", "infer", "encode"]
    assert stages["decode"].end_time <= stages["queue"].start_time + 1_000_000
    assert stages["queue"].end_time <= stages["infer"].start_time + 1_000_000


def test_the_infer_span_carries_the_size_of_the_batch_its_items_ran_in(traced):
    with traced(max_batch_size=4) as c:
        def send(tag: str, sleep: float = 0.0):
            return c.post("/api/v1/tint", params={"tag": tag, "sleep": sleep}, content=picture(16, 16), headers=PNG)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(send, "first", 1.5)  # holds the model while the others queue up together
            # the three are sent once the model runs "first", so none can run alone ahead of it
            # (a loaded machine once delivered them first, each in a call of its own)
            deadline = time.monotonic() + 30
            while ["first"] not in c.get("/record").json()["calls"]:
                assert time.monotonic() < deadline and not first.done(), "the model never ran the first request"
                time.sleep(0.01)
            rest = [pool.submit(send, f"r{i}") for i in range(3)]
            answers = [f.result().json() for f in (first, *rest)]
    by_tag = {a["tag"]: a["batch"] for a in answers}
    spans = [s for s in _requests(traced.exporter) if s.name == "POST /api/v1/tint"]
    assert len(spans) == 4
    sizes = {}
    for span in spans:
        infer = _children(traced.exporter, span)["infer"]
        sizes[infer.attributes["onecard.batch.size"]] = sizes.get(infer.attributes["onecard.batch.size"], 0) + 1
    assert sorted(sizes.items()) == sorted({n: list(by_tag.values()).count(n) for n in by_tag.values()}.items())
    assert max(by_tag.values()) > 1, by_tag  # the three that waited ran as one batch (or two): not a vacuous check


def test_a_5xx_is_an_error_span_and_a_4xx_is_not(traced):
    with traced() as c:
        assert c.post("/api/v1/tint", params={"mode": "boom"}, content=picture(16, 16), headers=PNG).status_code == 500
        assert c.post("/api/v1/tint", params={"mode": "bad"}, content=picture(16, 16), headers=PNG).status_code == 422
    boom, bad = _requests(traced.exporter)
    assert boom.status.status_code == StatusCode.ERROR and boom.attributes["error.type"] == "500"
    assert boom.attributes["http.response.status_code"] == 500
    assert bad.status.status_code == StatusCode.UNSET and bad.attributes["http.response.status_code"] == 422


def test_probes_and_refused_credentials_make_no_span(traced):
    with traced(api_key="k-1") as c:
        for probe in ("/healthz", "/readyz", "/metrics", "/stats"):
            assert c.get(probe).status_code == 200
        refused = c.post("/api/v1/tint", content=picture(16, 16),
                         headers={**PNG, "traceparent": f"00-{TRACE}-{CALLER}-01"})
        assert refused.status_code == 401
        assert traced.exporter.get_finished_spans() == ()
        assert c.get("/info", headers={"X-API-Key": "k-1"}).status_code == 200
    (span,) = _requests(traced.exporter)
    assert span.name == "GET /info" and span.parent is None


def test_with_traces_off_no_middleware_and_nothing_recorded(monkeypatch):
    for key in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(key, raising=False)
    app = create_app({"warmup_runs": 1})
    assert app.state.shell.traces is None
    assert not any(m.cls is TraceMiddleware for m in app.user_middleware)
    with TestClient(app) as c:
        assert c.post("/api/v1/tint", content=picture(16, 16), headers=PNG).status_code == 200


@pytest.mark.parametrize(("env", "wanted"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"}, False),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, False),  # naming is not asking
])
def test_what_turns_traces_on(env, wanted):
    assert traces_wanted(env) is wanted


def test_the_resource_names_the_service_and_its_unit(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod")
    env = {"ONECARD_NODE_NAME": "gpu-node-7", "ONECARD_INSTANCE_TOKEN": "inst-9"}
    attrs = resource_for("detect", env, "1.2.3").attributes
    assert attrs["service.name"] == "onecard-detect" and attrs["onecard.service"] == "detect"
    assert attrs["onecard.unit"] == "gpu-node-7" and attrs["service.instance.id"] == "inst-9"
    assert attrs["service.version"] == "1.2.3" and attrs["deployment.environment"] == "prod"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "faces")
    attrs = resource_for("detect", {**env, "OTEL_SERVICE_NAME": "faces"}, "1.2.3").attributes
    assert attrs["service.name"] == "faces" and attrs["onecard.service"] == "detect"


def test_exporters_follow_otel_traces_exporter_and_a_useless_setting_warns(caplog):
    assert [type(e) for e in exporters_from_environment({"OTEL_TRACES_EXPORTER": "console"})] == [ConsoleSpanExporter]
    exporters = exporters_from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert [type(e).__name__ for e in exporters] == ["OTLPSpanExporter"]
    with caplog.at_level(logging.WARNING, "onecard.traces"):
        assert traces_from_environment("svc", environ={"OTEL_TRACES_EXPORTER": "no-such-exporter"}) is None
    assert "no-such-exporter" in caplog.text and "without traces" in caplog.text

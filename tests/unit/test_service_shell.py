"""The service shell in-process (no serve.py): what every service gets from it whatever its
part. Credentials (API key and HTTP Basic) with the failure limiter in front of them, so that
an app built in-process has it too; probes open, with the instance on every answer; error
shapes per path; readiness from the part, 503 the moment the drain begins; the part's
figures in /stats and /metrics; one settings class whose keys every service has."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.jobs.settings import JobsSettings
from services.runtime.errors import ApiError
from services.runtime.pipeline.settings import ModelServiceSettings
from services.runtime.settings import ServiceSettings
from services.runtime.shell.app import ServiceShell
from services.runtime.shell.part import ServicePart


class Part(ServicePart):
    title = "a part"
    open_paths = frozenset({"/hello/open"})

    def __init__(self) -> None:
        self.ready = False
        self.drained = 0

    def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
        shell.error_shapes["/odd/"] = lambda exc: {"oops": exc.code}

        @app.get("/hello")
        async def hello() -> dict[str, Any]:
            return {"hello": True}

        @app.get("/hello/open")
        async def hello_open() -> dict[str, Any]:
            return {"open": True}

        @app.get("/odd/fail")
        async def odd() -> None:
            raise ApiError(418, "teapot", "short and stout")

    async def start(self, shell: ServiceShell) -> None:
        self.ready = True

    def begin_drain(self) -> None:
        self.drained += 1

    def readiness(self) -> str | None:
        return None if self.ready else "warming"

    def stats(self) -> dict[str, Any]:
        return {"served": 7}


def client(monkeypatch, **settings) -> tuple[TestClient, ServiceShell, Part]:
    monkeypatch.setenv("ONECARD_INSTANCE_TOKEN", "inst-1")
    monkeypatch.delenv("ONECARD_PROBE_SOCKET", raising=False)
    part = Part()
    shell = ServiceShell("t", ServiceSettings(**settings), part)
    return TestClient(shell.app(), raise_server_exceptions=False), shell, part


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_credentials_and_the_failure_limiter_hold_in_process(monkeypatch, tmp_path):
    pairs = tmp_path / "pairs"
    pairs.write_text("alice:s3cret\n")
    c, _, _ = client(monkeypatch, api_key="k-1", basic_auth_file=str(pairs), auth_max_failures=3)
    with c:
        assert c.get("/hello").status_code == 401
        assert c.get("/hello", headers={"X-API-Key": "k-1"}).json() == {"hello": True}
        assert c.get("/hello", headers=basic("alice", "s3cret")).status_code == 200
        assert c.get("/hello/open").status_code == 200 and c.get("/healthz").status_code == 200
        for _ in range(3):
            assert c.get("/hello", headers=basic("alice", "wrong")).status_code == 401
        locked = c.get("/hello", headers=basic("alice", "s3cret"))  # right, but the address is locked out
        assert locked.status_code == 429 and locked.json()["error"]["code"] == "too_many_auth_failures"
        assert int(locked.headers["retry-after"]) >= 1
        assert c.get("/healthz").status_code == 200  # probes are never refused


def test_probes_identity_error_shapes_and_the_drain(monkeypatch):
    c, shell, part = client(monkeypatch)
    with c:
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["instance"] == "inst-1"
        assert c.get("/hello").headers["x-onecard-instance"] == "inst-1"  # on every answer
        assert c.get("/stats").json()["served"] == 7
        assert c.get("/odd/fail").json() == {"oops": "teapot"}
        assert c.get("/nowhere").json()["error"]["code"] == "not_found"
        shell.begin_drain()
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "draining"
        assert c.get("/healthz").status_code == 200
    assert part.drained == 1
    assert "onecard_requests_total" in shell.metrics.exposition().decode()


def test_readiness_waits_for_the_part(monkeypatch):
    c, _, part = client(monkeypatch)
    with c:
        part.ready = False
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "warming"


@pytest.mark.parametrize("model", [ModelServiceSettings, JobsSettings])
def test_every_service_has_every_shared_key(model):
    assert set(ServiceSettings.model_fields) <= set(model.model_fields)
    with pytest.raises(ValueError):
        model(max_pipelined_requests=0)


@pytest.mark.parametrize("problem", [None, "the model call has run for 90 s"])
def test_healthz_answered_ahead_of_the_framework_is_the_routes_own_answer(monkeypatch, problem):
    """serve.py puts HealthAnswer in front of the app: the same status, document and headers
    as the route, the instance header included, and every other request goes on to the app."""
    from services.runtime.shell.health_answer import HealthAnswer
    c, shell, part = client(monkeypatch)
    with c:
        monkeypatch.setattr(part, "problem", lambda: problem, raising=False)
        routed = c.get("/healthz?probe=1")
        fast = TestClient(HealthAnswer(c.app, shell))
        answered = fast.get("/healthz?probe=1")
        assert (answered.status_code, answered.content) == (routed.status_code, routed.content)
        assert answered.status_code == (200 if problem is None else 503)
        assert answered.json()["instance"] == "inst-1" and (problem is None or answered.json()["reason"] == problem)
        assert dict(answered.headers) == dict(routed.headers) and answered.headers["x-onecard-instance"] == "inst-1"
        assert fast.get("/hello").json() == {"hello": True}
        assert fast.post("/healthz").status_code == 405 and fast.head("/healthz").status_code == 405


def test_openapi_json_is_rendered_once_and_is_what_fastapi_would_send(monkeypatch):
    """The document's bytes are made once (off the event loop) and served from then on:
    FastAPI's own route encoded the whole document on the loop at every request."""
    from fastapi.responses import JSONResponse

    from services.runtime.shell import api_docs
    renders = []

    class Counted(JSONResponse):
        def render(self, content):
            renders.append(1)
            return super().render(content)

    monkeypatch.setattr(api_docs, "JSONResponse", Counted)
    c, shell, part = client(monkeypatch)
    with c:
        answers = [c.get("/openapi.json") for _ in range(3)]
        assert c.head("/openapi.json").status_code == 200
        expected = JSONResponse(c.app.openapi()).body
    assert all(r.status_code == 200 and r.content == expected for r in answers)
    assert answers[0].headers["content-type"] == "application/json" and "/hello" in answers[0].json()["paths"]
    assert len(renders) == 1


def test_healthz_answered_ahead_of_the_framework_when_the_part_fails_is_the_routes_answer(monkeypatch):
    """A problem() that raises is answered as the route answered it: the 500 envelope, not
    the server's bare text."""
    from services.runtime.shell.health_answer import HealthAnswer
    c, shell, part = client(monkeypatch)

    def broken() -> str | None:
        raise RuntimeError("the part's state is broken")
    with c:
        monkeypatch.setattr(part, "problem", broken, raising=False)
        routed = c.get("/healthz")
        answered = TestClient(HealthAnswer(c.app, shell), raise_server_exceptions=False).get("/healthz")
    assert routed.status_code == answered.status_code == 500
    assert answered.headers["content-type"] == "application/json"
    assert answered.json()["error"]["code"] == routed.json()["error"]["code"] == "internal_error"


def test_openapi_json_is_not_shadowed_by_a_route_the_part_adds(monkeypatch):
    """/openapi.json and /docs are the shell's, whatever path patterns the service's routes take
    (the jobs service finds a target's routes in that document)."""

    class Pages(Part):
        def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
            super().add_routes(app, shell)

            @app.get("/{name}")
            async def page(name: str) -> dict[str, Any]:
                return {"page": name}

    monkeypatch.setenv("ONECARD_INSTANCE_TOKEN", "inst-1")
    monkeypatch.delenv("ONECARD_PROBE_SOCKET", raising=False)
    with TestClient(ServiceShell("t", ServiceSettings(), Pages()).app()) as c:
        assert c.get("/other").json() == {"page": "other"}
        assert "/hello" in c.get("/openapi.json").json()["paths"]
        assert "swagger" in c.get("/docs").text.lower()


@pytest.mark.parametrize("traces", [False, True])
def test_healthz_is_answered_ahead_only_of_the_shells_own_middleware(monkeypatch, traces):
    """serve.py puts HealthAnswer in front of a shell's app, traces or not; not in front of
    one that carries middleware of the service's own (added by its routes or its factory)."""
    from starlette.middleware.cors import CORSMiddleware

    from services.runtime.shell.health_answer import HealthAnswer, answering_ahead
    if traces:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    c, shell, _ = client(monkeypatch)
    assert (shell.traces is not None) == traces
    assert isinstance(answering_ahead(c.app, shell), HealthAnswer)
    c.app.add_middleware(CORSMiddleware, allow_origins=["*"])
    assert answering_ahead(c.app, shell) is c.app

    class WithMiddleware(Part):
        def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
            super().add_routes(app, shell)
            app.add_middleware(CORSMiddleware, allow_origins=["*"])
    shell = ServiceShell("t", ServiceSettings(), WithMiddleware())
    app = shell.app()
    assert answering_ahead(app, shell) is app


def test_a_schema_that_will_not_render_breaks_openapi_json_not_the_service(monkeypatch, caplog):
    """The document is rendered as the service starts; one that cannot be (an answer model
    with no JSON Schema) is logged, the service starts and /openapi.json answers the 500
    envelope."""
    from collections.abc import Callable

    from pydantic import BaseModel

    class Odd(BaseModel):
        fn: Callable[[], int]

    class OddPart(Part):
        def add_routes(self, app: FastAPI, shell: ServiceShell) -> None:
            super().add_routes(app, shell)

            @app.get("/odd-schema", response_model=Odd, response_model_exclude={"fn"})
            async def odd_schema() -> Any:
                return {"fn": len}

    monkeypatch.setenv("ONECARD_INSTANCE_TOKEN", "inst-1")
    monkeypatch.delenv("ONECARD_PROBE_SOCKET", raising=False)
    with TestClient(ServiceShell("t", ServiceSettings(), OddPart()).app(), raise_server_exceptions=False) as c:
        assert "the OpenAPI document cannot be built" in caplog.text
        assert c.get("/readyz").status_code == 200 and c.get("/hello").json() == {"hello": True}
        r = c.get("/openapi.json")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"

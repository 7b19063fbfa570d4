"""schemathesis against each real service's own OpenAPI schema: zero 5xx, and every
response that claims JSON errors uses the documented envelope.

Driven through schemathesis's Python API (each operation's hypothesis strategy)
rather than its pytest plugin, which does not load under the pytest we pin."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.service_harness import ServiceProcess

SERVICES = {
    "detect": ("services.detect.app:create_app", {"max_side": 128, "max_pixels": 4_000_000}),
    "img2img": ("services.img2img.app:create_app", {"max_side": 128, "max_pixels": 4_000_000, "max_steps": 50,
                                                    "max_images": 4}),
}


def _has_inputs(op) -> bool:
    definition = op.definition.raw
    return bool(definition.get("requestBody") or definition.get("parameters"))


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_no_server_errors(name, tmp_path):
    app, cfg = SERVICES[name]
    with ServiceProcess(app, cfg, tmp_path) as svc:
        schema = schemathesis.openapi.from_url(svc.url + "/openapi.json")
        operations = [op.ok() for op in schema.get_all_operations()]
        assert len(operations) >= (2 if name == "detect" else 20)
        server_errors = []
        calls: dict[str, int] = {}
        for op in operations:
            label = f"{op.method.upper()} {op.path}"
            examples = 30 if _has_inputs(op) else 2

            @given(case=op.as_strategy())
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def run(case):
                calls[label] = calls.get(label, 0) + 1  # noqa: B023 - run() is called in this iteration
                r = case.call(timeout=60)
                if r.status_code >= 500:
                    server_errors.append((case.method, case.path, r.status_code, r.text[:300]))

            run()
        bodies = [f"{op.method.upper()} {op.path}" for op in operations if op.definition.raw.get("requestBody")]
        assert bodies and all(calls.get(label, 0) >= 10 for label in bodies), calls  # bodies really explored
        assert all(calls.get(f"{op.method.upper()} {op.path}", 0) >= 1 for op in operations), calls
        assert server_errors == []
        assert svc.proc.poll() is None

"""schemathesis against each real service's own OpenAPI schema: zero 5xx.

Driven through schemathesis's Python API (each operation's hypothesis strategy)
rather than its pytest plugin, which does not load under the pytest we pin."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.service_harness import ServiceProcess

SERVICES = {
    "detect": ("services.detect.app:create_app", {"max_side": 128, "max_pixels": 4_000_000}),
    "img2img": ("services.img2img.app:create_app", {"max_side": 128, "max_pixels": 4_000_000, "max_steps": 50}),
}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_no_server_errors(name, tmp_path):
    app, cfg = SERVICES[name]
    with ServiceProcess(app, cfg, tmp_path) as svc:
        schema = schemathesis.openapi.from_url(svc.url + "/openapi.json")
        operations = [op.ok() for op in schema.get_all_operations()]
        assert len(operations) >= (2 if name == "detect" else 4)
        server_errors = []
        calls = 0
        for op in operations:
            @given(case=op.as_strategy())
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def run(case):
                nonlocal calls
                calls += 1
                r = case.call(timeout=60)
                if r.status_code >= 500:
                    server_errors.append((case.method, case.path, r.status_code, r.text[:300]))

            run()
        assert calls >= 40 * len(operations) // 2
        assert server_errors == []
        assert svc.proc.poll() is None

"""deploy/ must not drift from configs/gpu.toml: ports, probe paths, grace, CPU for the thread plan."""

from __future__ import annotations

import math
import re
import tomllib

import yaml

from supervisor.config import Config
from tests.harness import ROOT

CONFIG = tomllib.loads((ROOT / "configs" / "gpu.toml").read_text())
CFG = Config.model_validate(CONFIG)  # schema-valid (model paths exist only on the GPU host)
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
DOCS = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))
DEPLOYMENT = next(d for d in DOCS if d["kind"] == "Deployment")
SERVICE = next(d for d in DOCS if d["kind"] == "Service")
POD = DEPLOYMENT["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]


def test_probes_hit_the_supervisor_probe_port_and_paths():
    port = CFG.supervisor.health_port
    assert CONTAINER["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert CONTAINER["startupProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert CONTAINER["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert f"http://127.0.0.1:{port}/healthz" in DOCKERFILE


def test_startup_probe_allows_the_startup_timeout():
    sp = CONTAINER["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= CFG.supervisor.startup_timeout_s
    assert f"--start-period={int(CFG.supervisor.startup_timeout_s)}s" in DOCKERFILE


def test_termination_grace_exceeds_the_supervisor_grace():
    assert POD["terminationGracePeriodSeconds"] > CFG.supervisor.grace_s + 5


def test_every_port_is_exposed_and_declared():
    ports = {CFG.supervisor.health_port} | {s.port for s in CFG.services.values()}
    assert {p["containerPort"] for p in CONTAINER["ports"]} == ports
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.M).group(1).split()}
    assert exposed == ports
    named = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    for name, svc in CFG.services.items():
        assert named[name] == svc.port
        assert any(p["targetPort"] == name for p in SERVICE["spec"]["ports"])


def test_cpu_matches_the_thread_plan_and_one_gpu():
    threads = sum(s.threads for s in CFG.services.values())
    res = CONTAINER["resources"]
    assert float(res["limits"]["cpu"]) == float(res["requests"]["cpu"]) >= threads + 1
    assert math.isclose(float(res["limits"]["cpu"]), threads + 1)
    assert res["limits"]["nvidia.com/gpu"] == 1
    assert CFG.gpu.mps and "MPS in Kubernetes" in (ROOT / "deploy" / "kubernetes.yaml").read_text()


def test_entrypoint_is_run_sh_in_exec_form_with_the_gpu_config():
    assert 'ENTRYPOINT ["/app/run.sh"]' in DOCKERFILE
    assert "exec onecard run" in (ROOT / "run.sh").read_text()
    assert CONTAINER["args"] == ["--config", "/app/configs/gpu.toml"]
    assert 'pip install "torch==2.13.0"' in DOCKERFILE  # pinned, never an open range
    assert "--no-deps" in DOCKERFILE

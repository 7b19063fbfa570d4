"""deploy/jobs-kubernetes.yaml must not drift from what the jobs service does: each pool's
config is valid, its units consume the stream its ScaledObject watches, the queue URL comes
from the Secret, the grace covers the drain, and Redis keeps what it accepted."""

from __future__ import annotations

import tomllib

import pytest
import yaml

from services.jobs.settings import JobsSettings
from supervisor.config import Config
from tests.harness import ROOT

DOCS = list(yaml.safe_load_all((ROOT / "deploy" / "jobs-kubernetes.yaml").read_text()))
CONFIGS = {name: tomllib.loads(text) for name, text in
           next(d for d in DOCS if d["kind"] == "ConfigMap")["data"].items()}
POOLS = [d for d in DOCS if d["kind"] == "Deployment"]
SCALERS = {d["spec"]["scaleTargetRef"]["name"]: d for d in DOCS if d["kind"] == "ScaledObject"}


def pool_config(deployment: dict) -> tuple[Config, JobsSettings, dict]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    path = container["args"][container["args"].index("--config") + 1]
    raw = CONFIGS[path.rsplit("/", 1)[1]]
    config = Config.model_validate(raw)  # schema-valid (the model directories exist only on GPU nodes)
    return config, JobsSettings.model_validate(raw["services"]["jobs"]["settings"]), container


@pytest.mark.parametrize("deployment", POOLS, ids=lambda d: d["metadata"]["name"])
def test_each_pool_consumes_the_stream_its_scaler_watches(deployment):
    config, jobs, container = pool_config(deployment)
    labels = [jobs.target(n).model_label for n in jobs.targets]
    assert len(labels) == 1 and labels[0]  # one model per unit: nodes never switch models
    label = labels[0]
    assert deployment["spec"]["template"]["metadata"]["labels"]["onecard.io/model"] == label.replace("/", ".")
    trigger = SCALERS[deployment["metadata"]["name"]]["spec"]["triggers"][0]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    assert meta["stream"] == f"{jobs.queue.prefix}:stream:{label}" and meta["consumerGroup"] == jobs.queue.group
    assert "lagCount" in meta and "pendingEntriesCount" not in meta  # pull-based units: lag is the backlog
    env = {e["name"]: e for e in container["env"]}
    assert meta["addressFromEnv"] in env
    # every target is a service of the same unit, on its port
    for name in jobs.targets:
        assert jobs.target(name).url == f"http://127.0.0.1:{config.services[name].port}"


@pytest.mark.parametrize("deployment", POOLS, ids=lambda d: d["metadata"]["name"])
def test_the_queue_url_comes_from_the_secret_and_the_grace_covers_the_drain(deployment):
    config, jobs, container = pool_config(deployment)
    assert jobs.queue.url is None and jobs.queue.url_env
    ref = {e["name"]: e for e in container["env"]}[jobs.queue.url_env]["valueFrom"]["secretKeyRef"]
    secret = next(d for d in DOCS if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"])
    assert secret["stringData"][ref["key"]].startswith("redis://")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.supervisor.grace_s + (jobs.drain_s or 10)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["jobs"] == config.services["jobs"].port and ports["probes"] == config.supervisor.health_port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": config.supervisor.health_port}


def test_every_pool_accepts_the_other_pools_models_and_one_service_fronts_them_all():
    labels, accepted = set(), set()
    for deployment in POOLS:
        _, jobs, _ = pool_config(deployment)
        labels |= {jobs.target(n).model_label for n in jobs.targets}
        accepted |= set(jobs.accept_models)
    assert labels == accepted  # a pool scaled to zero still gets its jobs queued
    service = next(d for d in DOCS if d["kind"] == "Service" and d["metadata"]["name"] == "onecard-jobs")
    for deployment in POOLS:
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_redis_keeps_every_accepted_job():
    redis = next(d for d in DOCS if d["kind"] == "StatefulSet")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    joined = " ".join(args)
    assert "--appendonly yes" in joined and "--appendfsync always" in joined
    assert "--maxmemory-policy noeviction" in joined
    assert redis["spec"]["volumeClaimTemplates"]

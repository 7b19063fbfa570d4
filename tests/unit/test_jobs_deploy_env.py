"""deploy/jobs-kubernetes.yaml's environment and Redis run for real: the pod's variables go
through the supervisor's own config loading and plan (and a real supervisor) to the jobs
service, and the Redis container's arguments and probe command work on a real redis-server.
The supervisor keeps every ONECARD_* variable of its own environment from its services, so
the queue URL must have another name (it had ONECARD_REDIS_URL, and never arrived)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from services.jobs.settings import JobsSettings
from supervisor.config.loading import load_config
from supervisor.policy.plan import CpuQuota, build_plan
from tests.harness import ROOT, SupervisorRun, free_port
from tests.redis_server import RedisServer, redis_binary
from tests.unit.test_jobs_deploy import (
    DOCS,
    POD_NAME,
    POOLS,
    REDIS,
    SCALERS,
    SECRET,
    container,
    cpu_quota,
    pod,
    pod_env,
    pool_config,
)

by_name = pytest.mark.parametrize("deployment", POOLS, ids=lambda d: d["metadata"]["name"])


def jobs_child_env(config_text: str, environ: dict[str, str], tmp_path: Path, quota: CpuQuota) -> dict[str, str]:
    """What `onecard run` hands the jobs service: load_config and build_plan, as the CLI calls them.
    The models volume (/models on a GPU node) is a directory under tmp_path here."""
    models = tmp_path / "models"
    for found in re.findall(r'^model_path = "/models/([^"]+)"$', config_text, re.M):
        (models / found).mkdir(parents=True, exist_ok=True)
    path = tmp_path / "pool.toml"
    path.write_text(config_text.replace('"/models/', f'"{models}/'))
    config = load_config(path, environ=environ)
    plan = build_plan(config, quota, environ)
    return next(s for s in plan.services if s.name == "jobs").env


def config_text_of(deployment: dict) -> str:
    c = container(deployment)
    name = c["args"][c["args"].index("--config") + 1].rsplit("/", 1)[1]
    return next(d for d in DOCS if d["kind"] == "ConfigMap")["data"][name]


@by_name
def test_the_queue_url_reaches_the_jobs_service_through_the_supervisor(deployment, tmp_path, monkeypatch):
    config, jobs, c, _ = pool_config(deployment)
    assert jobs.queue.url is None and jobs.queue.url_env  # never in the ConfigMap
    assert not jobs.queue.url_env.startswith("ONECARD_")
    environ = pod_env(c)
    child = jobs_child_env(config_text_of(deployment), environ, tmp_path, cpu_quota(c))
    # the settings the child parses, resolved in the child's environment
    settings = JobsSettings.model_validate(json.loads(child["ONECARD_SERVICE_CONFIG"]))
    for var in list(os.environ):
        monkeypatch.delenv(var)
    for var, value in child.items():
        monkeypatch.setenv(var, value)
    assert settings.queue.resolved_url() == SECRET["stringData"]["url"]
    assert settings.resolved_node_name() == POD_NAME  # the unit's name in job states


@by_name
def test_every_variable_the_pod_sets_reaches_the_jobs_service_or_is_kedas(deployment, tmp_path):
    _, _, c, _ = pool_config(deployment)
    environ = pod_env(c)
    child = jobs_child_env(config_text_of(deployment), environ, tmp_path, cpu_quota(c))
    keda = {SCALERS[deployment["metadata"]["name"]]["spec"]["triggers"][0]["metadata"]["addressFromEnv"]}
    for e in c["env"]:
        assert not e["name"].startswith("ONECARD_"), f"{e['name']}: the supervisor keeps ONECARD_* from its services"
        assert e["name"] in keda or child.get(e["name"]) == environ[e["name"]], e["name"]


def test_an_onecard_variable_of_the_pod_never_reaches_a_service(tmp_path):
    deployment = POOLS[0]
    c = container(deployment)
    url = SECRET["stringData"]["url"]
    environ = {**pod_env(c), "ONECARD_REDIS_URL": url, "ONECARD_NODE_NAME": "n1", "JOBS_QUEUE_URL": url}
    child = jobs_child_env(config_text_of(deployment), environ, tmp_path, cpu_quota(c))
    assert child["JOBS_QUEUE_URL"] == url and child["HOSTNAME"] == POD_NAME
    assert "ONECARD_REDIS_URL" not in child and "ONECARD_NODE_NAME" not in child


@pytest.mark.parametrize("var, reaches", [("JOBS_QUEUE_URL", True), ("ONECARD_REDIS_URL", False)])
def test_a_real_supervisor_hands_the_queue_url_to_a_real_jobs_service(var, reaches, tmp_path):
    """The whole path: the pod's variable, `onecard run`, the jobs service's broker. Under an
    ONECARD_ name the variable never arrives, and the service refuses to start (exit 78, naming
    it) instead of running its own in-memory queue as it once did silently."""
    port = free_port()
    jobs = {"app": "services.jobs.app:create_app", "port": port, "threads": 1, "env": {"PYTHONPATH": str(ROOT)},
            "settings": {"consume": False, "queue": {"url_env": var}}}
    with RedisServer(tmp_path) as redis, \
            SupervisorRun(tmp_path, {"jobs": jobs}, env={var: redis.url}) as run:
        if not reaches:
            assert run.wait_exit(60) == 78
            assert f"{var} is not set or empty" in run.output()
            return
        run.wait_ready(60)
        environ = (Path("/proc") / str(run.child_pid("jobs")) / "environ").read_bytes().split(b"\0")
        assert f"{var}={redis.url}".encode() in environ
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()["jobs"]
        assert stats["mode"] == "redis"


def test_redis_args_and_probe_work_on_a_real_redis(tmp_path):
    """The manifest's own arguments and probe command against a real redis-server: the password
    is required, the probe answers 0 with the Secret's file and not without the password."""
    c = container(REDIS)
    conf_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "auth")
    (item,) = next(v for v in pod(REDIS)["volumes"] if v["name"] == "auth")["secret"]["items"]
    conf = tmp_path / item["path"]
    conf.write_text(SECRET["stringData"][item["key"]])
    args = [str(conf) if a == f"{conf_mount}/{item['path']}" else a for a in c["args"]]
    assert args[0] == str(conf)  # the image's entrypoint runs redis-server for a first argument *.conf
    port = free_port()
    proc = subprocess.Popen([redis_binary(), *args, "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        (probe,) = {json.dumps(c[p]["exec"]["command"]) for p in ("startupProbe", "readinessProbe")}
        assert " -a " not in probe and "REDISCLI_AUTH=" in probe  # a password on argv is in every ps
        command = [part.replace(f"{conf_mount}/{item['path']}", str(conf))
                   .replace("redis-cli ", f"redis-cli -p {port} ") for part in json.loads(probe)]

        def probe_rc() -> int:
            return subprocess.run(command, capture_output=True, timeout=10).returncode

        deadline = 50
        while probe_rc() != 0 and deadline:
            assert proc.poll() is None, "redis-server exited"
            deadline -= 1
            subprocess.run(["sleep", "0.1"])
        assert deadline, "the probe never passed"
        unauth = subprocess.run(["redis-cli", "-p", str(port), "set", "k", "v"], capture_output=True, text=True)
        assert "NOAUTH" in unauth.stdout + unauth.stderr
        conf.write_text("requirepass wrong-password\n")
        assert probe_rc() != 0
    finally:
        proc.kill()
        proc.wait(timeout=10)

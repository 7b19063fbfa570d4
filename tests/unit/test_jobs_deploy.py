"""deploy/jobs-kubernetes.yaml must not drift from what the jobs service and the supervisor do
(each pool's config is valid, its units consume the stream its ScaledObject watches, KEDA reaches
Redis, the grace covers the drain, Redis keeps what it accepted) and
must keep deploy/kubernetes.yaml's conventions on every container, Redis's included: non-root,
no privileges, read-only root with emptyDirs where it writes, probes, every port in a Service
and a NetworkPolicy, pinned images, skipped checkov findings with their reasons. The pods'
environment and Redis running for real: test_jobs_deploy_env.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

from services.jobs.settings import JobsSettings
from supervisor.config.derived import drain_of, termination_grace_min
from supervisor.config.schema import Config
from supervisor.policy.plan import CpuQuota, plan_threads
from tests.harness import ROOT
from tests.unit.test_deploy_manifests import STEPS, args_of, env_of, package_version

MANIFEST = (ROOT / "deploy" / "jobs-kubernetes.yaml").read_text()
# the deployment page lists every checkov skip and why
DEPLOYMENT_DOC = (ROOT / "docs" / "deployment.md").read_text()
DOCS = list(yaml.safe_load_all(MANIFEST))
NAMESPACE = next(d for d in DOCS if d["kind"] == "Namespace")
SECRET = next(d for d in DOCS if d["kind"] == "Secret")
CONFIGS = {name: tomllib.loads(text) for name, text in
           next(d for d in DOCS if d["kind"] == "ConfigMap")["data"].items()}
POOLS = [d for d in DOCS if d["kind"] == "Deployment"]
REDIS = next(d for d in DOCS if d["kind"] == "StatefulSet")
WORKLOADS = POOLS + [REDIS]
SERVICES = [d for d in DOCS if d["kind"] == "Service"]
NETPOLS = [d for d in DOCS if d["kind"] == "NetworkPolicy"]
SCALERS = {d["spec"]["scaleTargetRef"]["name"]: d for d in DOCS if d["kind"] == "ScaledObject"}
CORE_KINDS = {"Namespace", "Secret", "ConfigMap", "Service", "NetworkPolicy", "Deployment", "StatefulSet"}
IMAGE_UID = 10001  # the Dockerfile's USER, checked against it below
POD_NAME = "onecard-sd15-7d9f8c6b5-x2k4q"

by_name = pytest.mark.parametrize("deployment", POOLS, ids=lambda d: d["metadata"]["name"])
every_workload = pytest.mark.parametrize("workload", WORKLOADS, ids=lambda d: d["metadata"]["name"])


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    (c,) = pod(workload)["containers"]
    return c


def pool_config(deployment: dict) -> tuple[Config, JobsSettings, dict, dict]:
    c = container(deployment)
    path = c["args"][c["args"].index("--config") + 1]
    raw = CONFIGS[path.rsplit("/", 1)[1]]
    config = Config.model_validate(raw)  # schema-valid (the model directories exist only on GPU nodes)
    return config, JobsSettings.model_validate(raw["services"]["jobs"]["settings"]), c, raw


def pod_env(c: dict) -> dict[str, str]:
    """The environment Kubernetes gives the container: its env resolved, and the host name
    (the pod's name) that the container runtime sets."""
    env = {"HOSTNAME": POD_NAME, "PATH": "/opt/onecard/bin:/usr/bin:/bin"}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["name"] == SECRET["metadata"]["name"]
            env[e["name"]] = SECRET["stringData"][ref["key"]]
    return env


def cpu_quota(c: dict) -> CpuQuota:
    cpus = float(c["resources"]["limits"]["cpu"])
    return CpuQuota(cpus, "cgroup2", 64, cpus, None)  # the limit is the cgroup quota on a bigger node


# --- the jobs service: streams, queue URL, environment ------------------------------------------

@by_name
def test_each_pool_consumes_the_stream_its_scaler_watches(deployment):
    config, jobs, c, _ = pool_config(deployment)
    labels = [jobs.target(n).model_label for n in jobs.targets]
    assert len(labels) == 1 and labels[0]  # one model per unit: nodes never switch models
    label = labels[0]
    assert deployment["spec"]["template"]["metadata"]["labels"]["onecard.io/model"] == label.replace("/", ".")
    trigger = SCALERS[deployment["metadata"]["name"]]["spec"]["triggers"][0]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    assert meta["stream"] == f"{jobs.queue.prefix}:stream:{label}" and meta["consumerGroup"] == jobs.queue.group
    assert "lagCount" in meta and "pendingEntriesCount" not in meta  # pull-based units: lag is the backlog
    # every priority level's stream is watched, the same way
    triggers = SCALERS[deployment["metadata"]["name"]]["spec"]["triggers"]
    streams = [t["metadata"]["stream"] for t in triggers]
    assert streams == [f"{jobs.queue.prefix}:stream:{label}" + suffix for suffix in ("", ":high", ":low")]
    assert all({**t["metadata"], "stream": ""} == {**meta, "stream": ""} and t["type"] == trigger["type"]
               for t in triggers)
    # every target is a service of the same unit, on its port
    for name in jobs.targets:
        assert jobs.target(name).url == f"http://127.0.0.1:{config.services[name].port}"


@by_name
def test_keda_reaches_redis_by_its_full_name_with_the_secrets_password(deployment):
    scaler = SCALERS[deployment["metadata"]["name"]]
    meta = scaler["spec"]["triggers"][0]["metadata"]
    env = pod_env(container(deployment))
    # KEDA's operator resolves the address in its own namespace: a short name would miss
    host, port = env[meta["addressFromEnv"]].rsplit(":", 1)
    redis_svc = next(s for s in SERVICES if s["spec"]["selector"] == REDIS["spec"]["selector"]["matchLabels"])
    assert host == f"{redis_svc['metadata']['name']}.{NAMESPACE['metadata']['name']}.svc"
    assert int(port) == redis_svc["spec"]["ports"][0]["port"]
    url = urlsplit(env[pool_config(deployment)[1].queue.url_env])
    assert (url.hostname, url.port) == (host, int(port))
    auth = next(d for d in DOCS if d["kind"] == "TriggerAuthentication"
                and d["metadata"]["name"] == scaler["spec"]["triggers"][0]["authenticationRef"]["name"])
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "password" and ref["name"] == SECRET["metadata"]["name"]
    assert SECRET["stringData"][ref["key"]] == url.password


def test_the_secrets_three_keys_hold_one_password():
    data = SECRET["stringData"]
    (conf_password,) = re.findall(r"^requirepass (\S+)$", data["redis.conf"], re.M)
    assert data["password"] == urlsplit(data["url"]).password == conf_password


# --- resources, grace, probes -------------------------------------------------------------------

@by_name
def test_the_thread_plan_fits_the_pods_cpu_and_one_gpu(deployment):
    config, _, c, _ = pool_config(deployment)
    threads, warnings = plan_threads(config, cpu_quota(c))
    res = c["resources"]
    assert not warnings
    assert float(res["limits"]["cpu"]) == float(res["requests"]["cpu"]) == sum(threads.values()) + 1
    assert res["limits"]["memory"] == res["requests"]["memory"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 1


@every_workload
def test_every_container_has_requests_and_limits(workload):
    res = container(workload)["resources"]
    for kind in ("cpu", "memory"):
        assert res["requests"][kind] and res["limits"][kind]
    assert res["limits"]["memory"] == res["requests"]["memory"]  # no OOM kill under a node's pressure


@by_name
def test_timeouts_nest_from_the_jobs_drain_to_the_pods_grace(deployment):
    config, jobs, c, _ = pool_config(deployment)
    assert jobs.resolved_drain_s() < drain_of(config, "jobs") < config.supervisor.grace_s
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod(deployment)["terminationGracePeriodSeconds"] > pre_stop + termination_grace_min(config)
    # written down where operators change it
    assert re.search(r"drain_s[^<]*<[^<]*< supervisor grace_s", MANIFEST)
    assert re.search(r"grace_s[^<]*< terminationGracePeriodSeconds", MANIFEST)


@by_name
def test_probes_hit_the_supervisors_probe_port_and_allow_the_startup_timeout(deployment):
    config, _, c, _ = pool_config(deployment)
    port = config.supervisor.health_port
    assert c["startupProbe"]["httpGet"] == c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    sp = c["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= config.supervisor.startup_timeout_s


@every_workload
def test_every_container_has_startup_readiness_and_liveness_probes(workload):
    c = container(workload)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["periodSeconds"] and c[probe]["timeoutSeconds"], probe


# --- ports, Services, NetworkPolicies -----------------------------------------------------------

@by_name
def test_container_ports_are_the_configs(deployment):
    config, _, c, _ = pool_config(deployment)
    want = {"probes": config.supervisor.health_port, **{n: s.port for n, s in config.enabled_services().items()}}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == want


@every_workload
def test_every_port_is_in_a_service_that_selects_the_pod(workload):
    labels = workload["spec"]["template"]["metadata"]["labels"]
    for p in container(workload)["ports"]:
        assert any(s["spec"]["selector"].items() <= labels.items()
                   and {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} in s["spec"]["ports"]
                   for s in SERVICES), p


@every_workload
def test_a_network_policy_opens_exactly_the_pods_ports(workload):
    labels = workload["spec"]["template"]["metadata"]["labels"]
    (policy,) = [n for n in NETPOLS if n["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert opened == {p["containerPort"] for p in container(workload)["ports"]}


def test_redis_takes_connections_from_the_units_and_keda_only():
    redis_labels = REDIS["spec"]["selector"]["matchLabels"]
    policy = next(n for n in NETPOLS if n["spec"]["podSelector"]["matchLabels"] == redis_labels)
    (rule,) = policy["spec"]["ingress"]
    pool_labels = POOLS[0]["spec"]["template"]["metadata"]["labels"]
    sources = rule["from"]
    assert len(sources) == 2
    assert sources[0]["podSelector"]["matchLabels"].items() <= pool_labels.items()
    assert sources[1] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}}


def test_every_pool_accepts_the_other_pools_models_and_one_service_fronts_them_all():
    labels, accepted = set(), set()
    for deployment in POOLS:
        _, jobs, _, _ = pool_config(deployment)
        labels |= {jobs.target(n).model_label for n in jobs.targets}
        accepted |= set(jobs.accept_models)
    assert labels == accepted  # a pool scaled to zero still gets its jobs queued
    service = next(s for s in SERVICES if s["metadata"]["name"] == "onecard-jobs")
    for deployment in POOLS:
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@by_name
def test_keda_owns_the_replica_count_from_the_pools_minimum(deployment):
    spec = SCALERS[deployment["metadata"]["name"]]["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert deployment["spec"]["replicas"] == spec["minReplicaCount"] < spec["maxReplicaCount"]
    # a second unit needs a second free GPU: replace, do not surge
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


@by_name
def test_prometheus_scrapes_the_probe_port(deployment):
    config, _, _, _ = pool_config(deployment)
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.supervisor.health_port),
                     "prometheus.io/path": "/metrics"}


# --- security -----------------------------------------------------------------------------------

def test_everything_lives_in_one_namespace_under_the_restricted_standard():
    assert NAMESPACE["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for d in DOCS:
        if d is not NAMESPACE:
            assert d["metadata"].get("namespace") == NAMESPACE["metadata"]["name"], d["metadata"]["name"]
    assert {d["kind"] for d in DOCS} - {"TriggerAuthentication", "ScaledObject"} == CORE_KINDS


@every_workload
def test_every_container_runs_as_the_image_user_without_privileges(workload):
    (user,) = args_of("USER")
    assert user == f"{IMAGE_UID}:{IMAGE_UID}"
    spec, c = pod(workload), container(workload)
    pod_sc, sc = spec["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == pod_sc["runAsGroup"] == IMAGE_UID
    assert pod_sc["fsGroup"] == IMAGE_UID
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == sc["runAsGroup"] == IMAGE_UID
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert pod_sc["seccompProfile"] == sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False  # no ONECARD_REDIS_* service variables either


@by_name
def test_every_path_a_unit_writes_is_an_empty_dir(deployment):
    config, _, c, _ = pool_config(deployment)
    volumes = {v["name"]: v for v in pod(deployment)["volumes"]}
    scratch = [PurePosixPath(m["mountPath"]) for m in c["volumeMounts"]
               if "emptyDir" in volumes[m["name"]] and not m.get("readOnly")]
    env = env_of(STEPS)
    for path in (PurePosixPath(config.supervisor.control_socket).parent,
                 PurePosixPath(env["HOME"]), PurePosixPath(env["XDG_CACHE_HOME"])):
        assert any(path == m or m in path.parents for m in scratch), f"{path} is on the read-only root"
    assert all("sizeLimit" in v["emptyDir"] for v in volumes.values() if "emptyDir" in v)
    assert all(m["readOnly"] for m in c["volumeMounts"] if "emptyDir" not in volumes[m["name"]])
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True


@every_workload
def test_images_are_pinned_and_always_pulled(workload):
    c = container(workload)
    assert c["imagePullPolicy"] == "Always"
    name, tag = c["image"].rsplit(":", 1)
    if name == "onecard":
        assert tag == package_version()
    else:
        assert re.fullmatch(r"\d+\.\d+\.\d+", tag), c["image"]  # an exact release, not 7.2
    assert ":latest" not in MANIFEST


def test_checkov_skips_carry_their_reasons():
    skips = [(d["metadata"]["name"], v) for d in DOCS for k, v in d["metadata"].get("annotations", {}).items()
             if k.startswith("checkov.io/skip")]
    assert skips, "no skip at all: then this test and the list in docs/deployment.md must go"
    for _, value in skips:
        check, reason = value.split("=", 1)
        assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(reason.split()) >= 5
        assert check in DEPLOYMENT_DOC  # docs/deployment.md lists what is skipped and why
    # secrets as environment variables: only the queue URL of the pools, which url_env reads
    env_secret = {name for name, v in skips if v.startswith("CKV_K8S_35=")}
    assert env_secret == {d["metadata"]["name"] for d in POOLS}
    assert all(e["valueFrom"]["secretKeyRef"]["key"] == "url" for d in POOLS for e in container(d)["env"]
               if "valueFrom" in e and "secretKeyRef" in e["valueFrom"])


# --- Redis --------------------------------------------------------------------------------------

def test_redis_keeps_every_accepted_job():
    c = container(REDIS)
    joined = " ".join(c["args"])
    assert "--appendonly yes" in joined and "--appendfsync always" in joined
    assert "--maxmemory-policy noeviction" in joined
    # the AOF is the copy: no RDB snapshot to fork for, nor to write at SIGTERM within the grace
    assert c["args"][c["args"].index("--save") + 1] == ""
    # noeviction means nothing without maxmemory: Redis would grow until its container is killed
    (maxmemory,) = re.findall(r"--maxmemory (\d+)mb", joined)
    limit_mib = int(c["resources"]["limits"]["memory"].removesuffix("Gi")) * 1024
    assert int(maxmemory) <= 0.8 * limit_mib  # room for the AOF rewrite's fork and client buffers
    (claim,) = REDIS["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in c["volumeMounts"]
    assert "env" not in c  # the password comes from the Secret's file, not an environment variable


# --- the tools and the docs ---------------------------------------------------------------------

def test_lint_deploy_checks_both_manifests():
    dev = (ROOT / "dev.sh").read_text()
    body = dev[dev.index("lint_deploy() {"):]
    body = body[:body.index("\n}\n")]
    (manifests,) = re.findall(r"manifests=\(([^)]*)\)", body)
    assert set(manifests.split()) == {f"deploy/{p.name}" for p in (ROOT / "deploy").glob("*.yaml")}
    assert '--strict "${manifests[@]}"' in body and '-f "$manifest"' in body


def test_no_example_names_an_onecard_variable_as_the_queue_url():
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "configs").glob("*.toml"),
             *(ROOT / "deploy").glob("*.yaml")]
    for f in files:
        assert not re.search(r"url_env\s*=\s*\"ONECARD_", f.read_text()), f

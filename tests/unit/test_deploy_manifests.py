"""deploy/ must not drift from configs/gpu.toml, and must keep the conventions platform teams
check for: ports, probes, grace, CPU for the thread plan, non-root and read-only, pinned images,
a small build context, and one onnxruntime flavour that leaves `pip check` clean."""

from __future__ import annotations

import fnmatch
import importlib
import json
import math
import re
import shlex
import subprocess
import tomllib
from pathlib import PurePosixPath

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from supervisor.config.schema import Config
from tests.harness import ROOT

CONFIG = tomllib.loads((ROOT / "configs" / "gpu.toml").read_text())
CFG = Config.model_validate(CONFIG)  # schema-valid (model paths exist only on the GPU host)
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
MANIFEST = (ROOT / "deploy" / "kubernetes.yaml").read_text()
DOCS = list(yaml.safe_load_all(MANIFEST))
DEPLOYMENT = next(d for d in DOCS if d["kind"] == "Deployment")
SERVICE = next(d for d in DOCS if d["kind"] == "Service")
NETPOL = next(d for d in DOCS if d["kind"] == "NetworkPolicy")
POD = DEPLOYMENT["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The jobs API every unit serves (DESIGN, "Many units"); its port is declared even while
# configs/gpu.toml does not enable the jobs service.
JOBS_PORT = 7863


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in dockerfile.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in joined.splitlines() if ln.strip()]


STEPS = instructions(DOCKERFILE)


def args_of(kind: str) -> list[str]:
    return [a for k, a in STEPS if k == kind]


def env_of(dockerfile_steps) -> dict[str, str]:
    env: dict[str, str] = {}
    for k, a in dockerfile_steps:
        if k == "ENV":
            env.update(kv.split("=", 1) for kv in shlex.split(a))
    return env


def package_version() -> str:
    project = PYPROJECT["project"]
    if "version" in project:
        return project["version"]
    module, name = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def expected_ports() -> dict[str, int]:
    ports = {"probes": CFG.supervisor.health_port, "jobs": JOBS_PORT}
    ports.update({name: svc.port for name, svc in CFG.services.items()})
    return ports


# --- probes, ports, timeouts, CPU: against configs/gpu.toml ------------------------------------

def test_probes_hit_the_supervisor_probe_port_and_paths():
    port = CFG.supervisor.health_port
    assert CONTAINER["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert CONTAINER["startupProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert CONTAINER["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    (healthcheck,) = args_of("HEALTHCHECK")
    assert f"http://127.0.0.1:{port}/healthz" in healthcheck


def test_startup_probe_allows_the_startup_timeout():
    sp = CONTAINER["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= CFG.supervisor.startup_timeout_s
    assert f"--start-period={int(CFG.supervisor.startup_timeout_s)}s" in args_of("HEALTHCHECK")[0]


def test_termination_grace_covers_prestop_and_the_supervisor_grace():
    pre_stop = CONTAINER["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert POD["terminationGracePeriodSeconds"] >= pre_stop + CFG.supervisor.grace_s + 5
    # the nesting is written down where operators change it
    assert re.search(r"drain .*< supervisor grace_s", MANIFEST)
    assert re.search(r"grace_s .*< terminationGracePeriodSeconds", MANIFEST)


def test_every_port_is_declared_exposed_served_and_open():
    want = expected_ports()
    assert {p["name"]: p["containerPort"] for p in CONTAINER["ports"]} == want
    assert {p["name"]: p["port"] for p in SERVICE["spec"]["ports"]} == want
    assert all(p["targetPort"] == p["name"] for p in SERVICE["spec"]["ports"])
    (expose,) = args_of("EXPOSE")
    assert {int(p) for p in expose.split()} == set(want.values())
    assert {p["port"] for p in NETPOL["spec"]["ingress"][0]["ports"]} == set(want.values())
    assert NETPOL["spec"]["podSelector"]["matchLabels"] == SERVICE["spec"]["selector"]


def test_cpu_matches_the_thread_plan_and_one_gpu():
    threads = sum(s.threads for s in CFG.services.values())
    res = CONTAINER["resources"]
    assert float(res["limits"]["cpu"]) == float(res["requests"]["cpu"]) >= threads + 1
    assert math.isclose(float(res["limits"]["cpu"]), threads + 1)
    assert res["limits"]["memory"] == res["requests"]["memory"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 1
    assert CFG.gpu.mps and "MPS in Kubernetes" in MANIFEST


def test_prometheus_scrapes_the_probe_port():
    notes = DEPLOYMENT["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(CFG.supervisor.health_port)
    assert notes["prometheus.io/path"] == "/metrics"


# --- security: non-root, nothing writable but emptyDirs, pinned images --------------------------

def test_pod_runs_as_the_image_user_without_privileges():
    (user,) = args_of("USER")
    uid, gid = (int(x) for x in user.split(":"))  # numeric: runAsNonRoot can verify it
    assert uid >= 10000 and gid >= 10000
    pod_sc, sc = POD["securityContext"], CONTAINER["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == uid and pod_sc["runAsGroup"] == gid
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert pod_sc["seccompProfile"] == sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert POD["automountServiceAccountToken"] is False


def test_every_path_the_unit_writes_is_an_empty_dir():
    volumes = {v["name"]: v for v in POD["volumes"]}
    scratch = [PurePosixPath(m["mountPath"]) for m in CONTAINER["volumeMounts"]
               if "emptyDir" in volumes[m["name"]] and not m.get("readOnly")]
    env = env_of(STEPS)
    written = [PurePosixPath(CFG.supervisor.control_socket).parent,  # socket and private run dir
               PurePosixPath(env["HOME"]), PurePosixPath(env["XDG_CACHE_HOME"])]
    for path in written:
        assert any(path == m or m in path.parents for m in scratch), f"{path} is on the read-only root"
    assert all("sizeLimit" in volumes[v]["emptyDir"] for v in volumes if "emptyDir" in volumes[v])
    models = next(m for m in CONTAINER["volumeMounts"] if m["mountPath"] == "/models")
    assert models["readOnly"] is True


def test_images_are_pinned_to_the_package_version():
    version = package_version()
    assert CONTAINER["image"] == f"onecard:{version}"
    assert DEPLOYMENT["metadata"]["labels"]["app.kubernetes.io/version"] == version
    assert f'org.opencontainers.image.version="{version}"' in args_of("LABEL")[0]
    assert f"docker build -f deploy/Dockerfile -t onecard:{version} ." in DOCKERFILE
    (base,) = args_of("FROM")
    name, tag = base.split("@")[0].rsplit(":", 1)
    assert name == "nvidia/cuda" and re.fullmatch(r"\d+\.\d+\.\d+-base-ubuntu\d+\.\d+", tag)
    assert ":latest" not in DOCKERFILE + MANIFEST


def test_checkov_skips_carry_their_reasons():
    skips = {k: v for d in DOCS for k, v in d["metadata"].get("annotations", {}).items()
             if k.startswith("checkov.io/skip")}
    assert skips, "no skip at all: then this test and the list in docs/deployment.md must go"
    for value in skips.values():
        check, reason = value.split("=", 1)
        assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(reason.split()) >= 5


# --- the image: entrypoint, config, CUDA stack, pip check ---------------------------------------

def test_entrypoint_is_run_sh_in_exec_form_with_the_gpu_config():
    (entrypoint,) = args_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["/app/run.sh"]  # the supervisor is PID 1 and gets the signals
    assert "exec onecard run" in (ROOT / "run.sh").read_text()
    assert json.loads(args_of("CMD")[-1]) == CONTAINER["args"] == ["--config", "/app/configs/gpu.toml"]
    assert env_of(STEPS)["ONECARD_CONFIG"] == "/app/configs/gpu.toml"  # `docker exec c onecard status`
    assert json.loads(args_of("HEALTHCHECK")[0].split(" CMD ", 1)[1])[0] == "python3"


def test_build_pins_torch_and_checks_requirements_and_cuda():
    runs = args_of("RUN")
    assert 'pip install "torch==2.13.0"' in runs  # pinned and alone, never an open range
    (install,) = [r for r in runs if '".[gpu,otel]"' in r]  # the image can trace (OTEL_* turns it on)
    # the aliases must be in the same resolve as the packages that require their names
    assert "./packaging/onnxruntime-gpu-alias" in install
    assert "./packaging/opencv-python-headless-alias" in install
    assert "-r packaging/model-packages.txt" in install and "--no-deps" not in install
    order = [install.index(s) for s in ('".[gpu,otel]"', "ldconfig", "pip check", "deploy/check_cuda.py")]
    assert order == sorted(order)
    (base,) = args_of("FROM")
    cuda_major = int(base.split(":")[1].split(".")[0])
    check = importlib.import_module("deploy.check_cuda")
    assert cuda_major == check.DEFAULT_CUDA_MAJOR and cuda_major in check.CUDA_SONAMES


def test_gpu_alias_pins_the_build_the_gpu_extra_admits():
    alias = tomllib.loads((ROOT / "packaging" / "onnxruntime-gpu-alias" / "pyproject.toml").read_text())
    assert alias["project"]["name"] == "onnxruntime"
    (pin,) = (Requirement(r) for r in alias["project"]["dependencies"])
    (extra,) = (Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["gpu"])
    pinned = Version(str(pin.specifier).removeprefix("=="))
    assert pin.name == extra.name == "onnxruntime-gpu" and pinned in extra.specifier
    assert Version(alias["project"]["version"]).public == str(pinned)
    (cpu,) = (Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["cpu"])
    assert cpu.name == "onnxruntime"
    assert not any(Requirement(r).name.startswith("onnxruntime") for r in PYPROJECT["project"]["dependencies"])


def test_opencv_alias_requires_the_headless_build_the_project_pins():
    alias = tomllib.loads((ROOT / "packaging" / "opencv-python-headless-alias" / "pyproject.toml").read_text())
    assert alias["project"]["name"] == "opencv-python"
    (need,) = (Requirement(r) for r in alias["project"]["dependencies"])
    (own,) = (Requirement(r) for r in PYPROJECT["project"]["dependencies"]
              if Requirement(r).name == "opencv-python-headless")
    assert need.name == own.name and need.specifier == own.specifier


# --- .dockerignore: a small context that still has everything the Dockerfile copies -------------

def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a match on a parent
    directory covers what is inside; `**/` matches any depth."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for raw in patterns:
        negate, pat = raw.startswith("!"), raw.lstrip("!").rstrip("/")
        pats = [pat, pat.removeprefix("**/")] if pat.startswith("**/") else [pat]
        hit = any(fnmatch.fnmatchcase(pre, p) or (p != pat and fnmatch.fnmatchcase(pre.rsplit("/", 1)[-1], p))
                  for pre in prefixes for p in pats)
        if hit:
            result = not negate
    return result


DOCKERIGNORE = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]


def test_dockerignore_keeps_out_environments_history_and_results():
    for path in (".venv/lib/python3.11/site-packages/torch/lib/libtorch.so", ".git/HEAD", ".venv-lint/bin/x",
                 "bench/results/run.json", "tests/unit/test_config.py", ".hypothesis/examples/x",
                 "services/runtime/__pycache__/app.cpython-311.pyc", "sample.jpg", "onecard.egg-info/PKG-INFO"):
        assert ignored(path, DOCKERIGNORE), path


def source_files(src: str) -> list[str]:
    """What a clone has under src: tracked files and new ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", src],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in listed if (ROOT / f).is_file()]


def test_dockerignore_keeps_every_file_the_dockerfile_copies():
    sources = [src for a in args_of("COPY") for src in a.split()[:-1]]
    assert len(sources) >= 8
    for src in sources:
        files = source_files(src)
        assert files, src
        for f in files:
            assert not ignored(f, DOCKERIGNORE), f

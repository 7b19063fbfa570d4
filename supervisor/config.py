"""The onecard configuration: TOML, validated with pydantic, with overrides.

Precedence, lowest first: built-in defaults < the TOML file < ``ONECARD_*``
environment variables < ``--set key=value`` options. An override's value is parsed
as a TOML value (``9000`` is an integer, ``true`` a boolean, ``[1, 2]`` a list);
anything that is not valid TOML is taken as a string.

Environment variables name a key with ``__`` between its parts, for example
``ONECARD_SERVICES__DETECT__PORT=9000`` or ``ONECARD_SUPERVISOR__GRACE_S=5``. Only
variables whose first part is a top-level section (``SUPERVISOR``, ``GPU``,
``SERVICES``) are overrides, so the variables the supervisor passes to its children
(``ONECARD_SERVICE_NAME`` ...) never leak back in. Key parts are lower-cased (the schema's
keys are), except a variable name under ``env``, which keeps its case:
``ONECARD_SERVICES__DETECT__ENV__HF_HOME`` sets ``services.detect.env.HF_HOME``.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor.errors import ConfigError
from supervisor.redact import REDACTED, is_secret_name, scrub_text
from supervisor.status import DEFAULT_CONTROL_SOCKET

ENV_PREFIX = "ONECARD_"
SECTIONS = ("supervisor", "gpu", "services")
SERVICE_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
APP_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


# AF_UNIX paths: 108 bytes with the terminating NUL.
UNIX_PATH_MAX = 107
# Seconds between a service's own drain timeout and the supervisor's SIGKILL, by default:
# room for the service's shutdown (lifespan, freeing the GPU) after its drain ends.
DRAIN_MARGIN_S = 2.0
# What `onecard run` needs after the services are gone: MPS quit (when on), the last log lines.
FLUSH_MARGIN_S = 3.0

__all__ = ["ConfigError", "Config", "load_config"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class SupervisorSettings(_Strict):
    grace_s: float = Field(10.0, gt=0, le=3600, description="SIGTERM to SIGKILL wait")
    drain_s: float | None = Field(None, gt=0, le=3600, description="each service's own graceful drain "
                                  "timeout, below grace_s (default: grace_s minus min(2 s, grace_s / 2))")
    startup_timeout_s: float = Field(300.0, gt=0, description="time for every service to become ready")
    readiness_period_s: float = Field(0.2, gt=0, le=60, description="/readyz poll period during start-up")
    liveness_period_s: float = Field(5.0, gt=0, le=3600, description="/healthz probe period once ready")
    liveness_timeout_s: float = Field(2.0, gt=0, le=600, description="one probe's time limit")
    liveness_failures: int = Field(3, ge=1, le=1000, description="misses in a row that count as death")
    health_host: str = Field("", description="bind address of the probe port: \"\" is every interface, "
                             "IPv4 and IPv6 (the pod IP whichever family the cluster uses)")
    health_port: int = Field(7860, ge=0, le=65535, description="probe port; 0 disables it")
    health_max_clients: int = Field(512, ge=1, le=65536, description="probe-port connections open at once; "
                                    "past it the longest-idle one is closed to make room")
    health_idle_timeout_s: float = Field(1.0, gt=0, le=60, description="time a probe-port client has to send "
                                         "its whole request (408 or closed after it)")
    control_socket: str = Field(DEFAULT_CONTROL_SOCKET, description="unix socket for `onecard status`")
    control_max_clients: int = Field(1024, ge=1, le=65536, description="control-socket connections open at "
                                     "once; past it the longest-idle one is closed to make room")
    control_idle_timeout_s: float = Field(1.0, gt=0, le=60, description="time a control client has to send "
                                          "its command")
    containment: Literal["auto", "cgroup2", "cgroup1", "process"] = Field(
        "auto", description="how everything a service starts is kept and ended with it: a cgroup per service "
        "(v2, else v1), else its process tree and environment marker; auto takes the first that works")
    run_dir: str | None = Field(None, description="the supervisor's private directory (0700): probe "
                                "sockets, MPS pipes (default: the control socket's path + '.d')")
    sample_period_s: float = Field(5.0, gt=0, le=3600, description="CPU, memory and GPU sampling period "
                                   "(in a worker thread)")
    log_buffer_lines: int = Field(10000, ge=100, le=10_000_000, description="lines held for a slow stdout "
                                  "before new ones are dropped (and counted)")
    log_format: Literal["text", "json"] = "text"


class GpuSettings(_Strict):
    visible_devices: str = Field("0", description="CUDA_VISIBLE_DEVICES given to every service")
    mps: bool = Field(False, description="run services under the NVIDIA MPS control daemon")
    mps_dir: str | None = Field(None, description="MPS pipe and log directories go here "
                                "(default: beside the control socket)")
    mps_start_timeout_s: float = Field(10.0, gt=0, le=300, description="wait for the MPS daemon's control pipe")
    mps_stop_timeout_s: float = Field(10.0, gt=0, le=300, description="wait for the MPS daemon to quit "
                                      "before SIGKILL")


class ServiceSettings(_Strict):
    app: str | None = Field(None, description="ASGI app factory, 'module:function'")
    command: list[str] | None = Field(None, description="full command line instead of app")
    host: str = "127.0.0.1"
    port: int = Field(..., ge=1, le=65535)
    threads: int | Literal["auto"] = Field("auto", description="CPU threads for the service's libraries")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    settings: dict[str, Any] = Field(default_factory=dict, description="the service's own section")
    enabled: bool = True
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1, description="GPU memory budget, share of the card")
    gpu_memory_bytes: int | None = Field(None, gt=0, description="GPU memory budget in bytes")
    memory_fraction: float | None = Field(None, gt=0, le=1, description="host memory budget, share of the unit's "
                                          "memory limit (default: an equal share of what the others leave)")
    memory_bytes: int | None = Field(None, gt=0, description="host memory budget in bytes")
    mps_thread_percentage: int | None = Field(None, ge=1, le=100,
                                              description="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE under MPS")
    drain_s: float | None = Field(None, gt=0, le=3600, description="this service's drain timeout "
                                  "(default: supervisor.drain_s)")

    @field_validator("app")
    @classmethod
    def _app_shape(cls, v: str | None) -> str | None:
        if v is not None and not APP_RE.fullmatch(v):
            raise ValueError("expected 'package.module:factory'")
        return v

    @field_validator("command")
    @classmethod
    def _command_shape(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0]):
            raise ValueError("expected a non-empty list of arguments")
        return v

    @field_validator("threads")
    @classmethod
    def _threads_positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("expected a whole number >= 1 or \"auto\"")
        return v

    @model_validator(mode="after")
    def _one_launcher(self) -> "ServiceSettings":
        if (self.app is None) == (self.command is None):
            raise ValueError("set exactly one of 'app' and 'command'")
        if self.gpu_memory_fraction is not None and self.gpu_memory_bytes is not None:
            raise ValueError("set at most one of 'gpu_memory_fraction' and 'gpu_memory_bytes'")
        if self.memory_fraction is not None and self.memory_bytes is not None:
            raise ValueError("set at most one of 'memory_fraction' and 'memory_bytes'")
        return self


class Config(_Strict):
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    services: dict[str, ServiceSettings] = Field(default_factory=dict)

    @field_validator("services")
    @classmethod
    def _names(cls, v: dict[str, ServiceSettings]) -> dict[str, ServiceSettings]:
        for name in v:
            if not SERVICE_NAME_RE.match(name):
                raise ValueError(f"service name {name!r}: expected lower-case letters, digits, '-' or '_'")
        return v

    def enabled_services(self) -> dict[str, ServiceSettings]:
        return {n: s for n, s in self.services.items() if s.enabled}


def parse_value(text: str) -> Any:
    """An override's value as TOML would read it, else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict[str, Any], dotted: list[str], value: Any, origin: str) -> None:
    node = tree
    for part in dotted[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(dotted)}: {part!r} is a value, not a table")
        node = child
    node[dotted[-1]] = value


def _overrides_from_env(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    found = []
    for var, text in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        parts = var[len(ENV_PREFIX):].split("__")
        if len(parts) < 2 or parts[0].lower() not in SECTIONS or not all(parts):
            continue
        found.append((".".join(_key_case(parts)), text, f"environment variable {var}"))
    return found


def _key_case(parts: list[str]) -> list[str]:
    """Lower-case the schema's keys; a variable name under services.NAME.env keeps its case."""
    out = [p.lower() for p in parts]
    if len(parts) >= 4 and out[0] == "services" and out[2] == "env":
        out[3:] = parts[3:]
    return out


def _overrides_from_set(items: list[str]) -> list[tuple[str, str, str]]:
    found = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        found.append((key, text.strip(), f"--set {key}"))
    return found


def _describe(err: dict[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "missing":
        return "required key is missing"
    value = err.get("input")
    if any(is_secret_name(str(p)) for p in err["loc"]):
        return f"{msg}, got {REDACTED}"
    if not isinstance(value, (dict, list)):
        msg = f"{msg}, got {value!r}"
    return scrub_text(msg)  # a URL's password, in the value or in the validator's own message


GpuTotal = Callable[[str], "int | None"]


def load_config(
    path: str | Path | None,
    sets: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    gpu_total_bytes: int | GpuTotal | None = None,
    origin: str | None = None,
) -> Config:
    """Read, merge and validate; every problem found is raised as one ConfigError.

    ``gpu_total_bytes`` may be a function of ``gpu.visible_devices`` so that byte budgets
    are judged against the card the services will use. ``origin`` names what chose the
    file (``--config``, ``ONECARD_CONFIG``) in the messages about the file itself."""
    environ = os.environ if environ is None else environ
    label = str(path) if path is not None else "<defaults>"
    who = f"{origin}: {label}" if origin else label
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{who}: no such file") from None
        except IsADirectoryError:
            raise ConfigError(f"{who}: is a directory, expected a TOML file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{who}: cannot read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{who}: not valid TOML: {exc}") from None

    origins: dict[str, str] = {}
    for key, text, origin in _overrides_from_env(environ) + _overrides_from_set(sets or []):
        _set_path(raw, key.split("."), parse_value(text), origin)
        origins[key] = origin

    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            where = origins.get(key, label)
            lines.append(f"{where}: {key}: {_describe(err)}")
        raise ConfigError("\n".join(lines)) from None

    total = gpu_total_bytes(config.gpu.visible_devices) if callable(gpu_total_bytes) else gpu_total_bytes
    problems = semantic_problems(config, total)
    if problems:
        raise ConfigError("\n".join(f"{origins.get(p.partition(':')[0], label)}: {p}" for p in problems))
    return config


def run_dir_of(config: Config) -> str:
    """The supervisor's private directory: created 0700 by the supervisor, never a directory
    it did not create (pointing control_socket at /run/onecard.sock leaves /run alone)."""
    return config.supervisor.run_dir or config.supervisor.control_socket + ".d"


def probe_socket_of(config: Config, name: str) -> str:
    return os.path.join(run_dir_of(config), "probes", f"{name}.sock")


def drain_of(config: Config, name: str | None = None) -> float:
    """A service's own graceful drain timeout: strictly below grace_s, so that a drain that
    runs out ends with the service exiting on its own, not with our SIGKILL."""
    svc = config.services.get(name)  # None (no name) is no service's name
    if svc is not None and svc.drain_s is not None:
        return svc.drain_s
    s = config.supervisor
    if s.drain_s is not None:
        return s.drain_s
    return s.grace_s - min(DRAIN_MARGIN_S, s.grace_s / 2)


def termination_grace_min(config: Config) -> float:
    """The least the orchestrator must wait after SIGTERM before its SIGKILL (Kubernetes
    terminationGracePeriodSeconds, docker stop --time): the services' grace, the MPS
    daemon's quit, the last log lines."""
    extra = config.gpu.mps_stop_timeout_s if config.gpu.mps else 0.0
    return config.supervisor.grace_s + extra + FLUSH_MARGIN_S


UNIT_MEMORY_SHARE = 0.9  # of the unit's memory limit, for its services; the rest: supervisor, sentinel, kernel


def budget_fractions(config: Config, total_bytes: int | None) -> dict[str, float | None]:
    """Each service's GPU memory budget as a share of the card (None: no budget, or bytes
    that cannot be converted without knowing the card)."""
    out: dict[str, float | None] = {}
    for name, svc in config.enabled_services().items():
        if svc.gpu_memory_fraction is not None:
            out[name] = svc.gpu_memory_fraction
        elif svc.gpu_memory_bytes is not None and total_bytes:
            out[name] = svc.gpu_memory_bytes / total_bytes
        else:
            out[name] = None
    return out


def semantic_problems(config: Config, gpu_total_bytes: int | None = None) -> list[str]:
    """Rules across keys that pydantic's per-field checks cannot see."""
    problems = []
    grace = config.supervisor.grace_s
    if config.supervisor.drain_s is not None and config.supervisor.drain_s >= grace:
        problems.append(f"supervisor.drain_s: {config.supervisor.drain_s:g} s must be below supervisor.grace_s "
                        f"({grace:g} s): a service's drain ends before the supervisor's SIGKILL")
    for name, svc in config.enabled_services().items():
        if svc.drain_s is not None and svc.drain_s >= grace:
            problems.append(f"services.{name}.drain_s: {svc.drain_s:g} s must be below supervisor.grace_s "
                            f"({grace:g} s)")
        if svc.app is not None:
            sock = probe_socket_of(config, name)
            if len(sock.encode()) > UNIX_PATH_MAX:
                problems.append(f"supervisor.run_dir: the probe socket {sock} is {len(sock.encode())} bytes, "
                                f"over the {UNIX_PATH_MAX} a unix socket path may have; set a shorter "
                                f"supervisor.run_dir or control_socket")
    if len(config.supervisor.control_socket.encode()) > UNIX_PATH_MAX:
        problems.append(f"supervisor.control_socket: {len(config.supervisor.control_socket.encode())} bytes, "
                        f"over the {UNIX_PATH_MAX} a unix socket path may have")
    shares = budget_fractions(config, gpu_total_bytes)
    total_share = sum(v for v in shares.values() if v is not None)
    if total_share > 1.0 + 1e-9:
        parts = ", ".join(f"{n} {v:.2f}" for n, v in shares.items() if v is not None)
        problems.append(f"services.*.gpu_memory_fraction: budgets add up to {total_share:.2f} of the card "
                        f"({parts}); expected at most 1.0")
    host_share = sum(s.memory_fraction or 0.0 for s in config.enabled_services().values())
    if host_share > UNIT_MEMORY_SHARE + 1e-9:
        problems.append(f"services.*.memory_fraction: budgets add up to {host_share:.2f} of the unit's memory; "
                        f"expected at most {UNIT_MEMORY_SHARE:g} (the rest is the supervisor's and the kernel's)")
    seen: dict[int, str] = {}
    if config.supervisor.health_port:
        seen[config.supervisor.health_port] = "supervisor.health_port"
    for name, svc in config.enabled_services().items():
        key = f"services.{name}.port"
        if svc.port in seen:
            problems.append(f"{key}: port {svc.port} is already used by {seen[svc.port]}")
        else:
            seen[svc.port] = key
        for skey, value in svc.settings.items():
            if skey.endswith(("_path", "_dir")) and isinstance(value, str) and value:
                if not Path(value).exists():
                    problems.append(f"services.{name}.settings.{skey}: no such file or directory: {value}")
        problems += _service_settings_problems(name, svc)
    if not config.enabled_services():
        problems.append("services: expected at least one enabled service")
    return problems


def _service_settings_problems(name: str, svc: ServiceSettings) -> list[str]:
    """A service that publishes its settings model (``<package>.settings.SERVICE_SETTINGS``,
    pydantic only, no ML import) has its section checked here, before anything starts."""
    if svc.app is None:
        return []
    package = svc.app.rpartition(".")[0]  # "pkg.module:factory" -> "pkg" (APP_RE: no dot after ':')
    if not package:
        return []
    try:
        import importlib
        model = getattr(importlib.import_module(f"{package}.settings"), "SERVICE_SETTINGS", None)
    except ImportError:
        return []
    if model is None:
        return []
    try:
        model.model_validate(svc.settings)
    except ValidationError as exc:
        return [f"services.{name}.settings.{'.'.join(str(p) for p in e['loc']) or '(section)'}: {_describe(e)}"
                .replace(".(section)", "") for e in exc.errors()]
    return []

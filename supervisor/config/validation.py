"""Rules across keys that pydantic's per-field checks cannot see, and each service's own
settings section checked against the model its package publishes. Every message names the
key; a secret value never appears in one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from supervisor.config.derived import UNIT_MEMORY_SHARE, UNIX_PATH_MAX, budget_fractions, probe_socket_of
from supervisor.config.redact import REDACTED, is_secret_name, scrub_text
from supervisor.config.schema import Config, ServiceSettings

# pydantic's error types for a key the schema does not have (a model's, a dataclass's)
_UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")
_MISSING_KEY = ("missing", "missing_argument")


def describe_error(err: dict[str, Any]) -> str:
    """One pydantic error as the config's messages say it."""
    msg = err["msg"]
    if err["type"] in _UNKNOWN_KEY:
        return "unknown key"
    if err["type"] in _MISSING_KEY:
        return "required key is missing"
    value = err.get("input")
    if any(is_secret_name(str(p)) for p in err["loc"]):
        return f"{msg}, got {REDACTED}"
    if not isinstance(value, (dict, list)):
        msg = f"{msg}, got {value!r}"
    return scrub_text(msg)  # a URL's password, in the value or in the validator's own message


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
        return [f"services.{name}.settings.{'.'.join(str(p) for p in e['loc']) or '(section)'}: {describe_error(e)}"
                .replace(".(section)", "") for e in exc.errors()]
    return []


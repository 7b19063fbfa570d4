"""Reading the onecard configuration: TOML, overrides, validation, one error for all problems.

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
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from supervisor.config.errors import ConfigError
from supervisor.config.schema import Config
from supervisor.config.validation import describe_error, semantic_problems

ENV_PREFIX = "ONECARD_"
SECTIONS = ("supervisor", "gpu", "services")


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
            lines.append(f"{where}: {key}: {describe_error(err)}")
        raise ConfigError("\n".join(lines)) from None

    total = gpu_total_bytes(config.gpu.visible_devices) if callable(gpu_total_bytes) else gpu_total_bytes
    problems = semantic_problems(config, total)
    if problems:
        raise ConfigError("\n".join(f"{origins.get(p.partition(':')[0], label)}: {p}" for p in problems))
    return config

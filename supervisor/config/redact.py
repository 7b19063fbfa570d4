"""Secrets never reach a terminal or a log: what the supervisor prints of a config, an
environment or a command line goes through here first.

A value is secret when its name says so (``API_KEY``, ``HF_TOKEN``, ``password`` ...),
and a URL's password is secret wherever it appears (``redis://user:pw@host``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"(?i)(key|token|secret|passw|credential|auth|cookie|private|signature)")
# the password runs to the @ (a '/' or '?' in it is common, and unencoded in hand-written URLs)
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<pw>[^@\s]+)(?P<tail>@)", re.I)
# Environment variables whose value is JSON settings: secrets are found inside by key name.
JSON_VARS = frozenset({"ONECARD_SERVICE_CONFIG"})


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def scrub_text(text: str) -> str:
    """Passwords inside URLs."""
    return _URL_PASSWORD.sub(lambda m: m["head"] + REDACTED + m["tail"], text)


def redact_value(name: str, value: Any) -> Any:
    if is_secret_name(name) and value not in (None, "", {}, []):
        if isinstance(value, (dict, list)):
            return redact_tree(value) if isinstance(value, dict) else REDACTED
        return REDACTED
    if isinstance(value, dict):
        return redact_tree(value)
    if isinstance(value, list):
        return [redact_value(name, v) for v in value]
    if isinstance(value, str):
        return scrub_text(value)
    return value


def redact_tree(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: redact_value(str(k), v) for k, v in doc.items()}


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name, value in env.items():
        if name in JSON_VARS:
            try:
                out[name] = json.dumps(redact_tree(json.loads(value)), sort_keys=True)
                continue
            except (ValueError, AttributeError):
                pass
        out[name] = redact_value(name, value)
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """``--api-key X`` and ``--api-key=X`` lose X; URLs lose their passwords."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-") and "=" in arg:
            flag, _, value = arg.partition("=")
            out.append(f"{flag}={REDACTED}" if is_secret_name(flag) else scrub_text(arg))
            continue
        if arg.startswith("-") and is_secret_name(arg):
            hide_next = True
        out.append(scrub_text(arg))
    return out

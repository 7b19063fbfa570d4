"""Whether the environment asks for traces, read without importing opentelemetry."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

EXPORTERS = "OTEL_TRACES_EXPORTER"
ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    return [n.strip().lower() for n in environ.get(EXPORTERS, "").split(",") if n.strip()]


def traces_wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """The standard variables' meaning: OTEL_SDK_DISABLED=true wins; an explicit
    OTEL_TRACES_EXPORTER says it (``none`` alone: off); else an OTLP endpoint turns them on."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = exporter_names(environ)
    if names:
        return any(n != "none" for n in names)
    return any(environ.get(k, "").strip() for k in ENDPOINTS)


def default_service_name(service: str) -> str:
    return f"onecard-{service}"


def unit_name(environ: Mapping[str, str] = os.environ) -> str:
    """The unit a service belongs to: its node (the pod's name on Kubernetes), as the jobs
    service names it."""
    return environ.get("ONECARD_NODE_NAME") or environ.get("HOSTNAME") or socket.gethostname() or "node"

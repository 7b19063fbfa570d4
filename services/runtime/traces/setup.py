"""Traces for a service process, when the environment asks for them: the one place that
decides, and the only import path to opentelemetry (which stays unimported otherwise)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from services.runtime.traces.config import traces_wanted

if TYPE_CHECKING:
    from services.runtime.traces.tracer import Traces

log = logging.getLogger("onecard.traces")


def traces_from_environment(service: str, version: str = "", environ: Mapping[str, str] = os.environ
                            ) -> Traces | None:
    """The service's Traces, or None: not asked for, the extra not installed (one warning, the
    service runs without traces), or a configuration that names nothing usable."""
    if not traces_wanted(environ):
        return None
    try:
        from services.runtime.traces.tracer import build_from_environment
    except ImportError as exc:
        log.warning("traces: the OTEL_* variables ask for traces but OpenTelemetry is not installed (%s); %s runs "
                    "without traces. Install the extra: pip install 'onecard[otel]'", exc, service)
        return None
    try:
        return build_from_environment(service, environ, version)
    except Exception as exc:  # noqa: BLE001 - a tracing setup that cannot work must not stop the service
        log.warning("traces: cannot set up traces from the OTEL_* variables (%s: %s); %s runs without traces",
                    type(exc).__name__, exc, service)
        return None

"""A service process's tracer: the SDK's TracerProvider, its resource, its exporters.

Spans leave through a BatchSpanProcessor: they are queued on the event loop (a deque
append) and encoded and sent by the processor's own thread, never on the loop. What the
exporters are, where they send, the sampler and the batch sizes all come from the
standard OTEL_* variables, read by the SDK itself.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.runtime.traces.config import default_service_name, exporter_names, unit_name

log = logging.getLogger("onecard.traces")
STOP_FLUSH_S = 2.0  # what the last spans may add to a drain: well inside the supervisor's grace
_global_set = False


class Traces:
    """What the shell and the jobs service trace with; one per service process."""

    def __init__(self, provider: TracerProvider, version: str = ""):
        self.provider = provider
        self.tracer = provider.get_tracer("onecard", version or None)

    # ---- contexts ----------------------------------------------------------------------
    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context:
        """The caller's context from W3C traceparent/tracestate (the configured propagators)."""
        return propagate.extract(carrier)

    @staticmethod
    def carrier_of(span: Span) -> dict[str, str]:
        """traceparent (and tracestate) of ``span``, to send along or to keep with a job."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def context_of(span: Span) -> Context:
        return trace.set_span_in_context(span)

    @staticmethod
    def new_trace() -> Context:
        """A parent that starts a trace of its own, whatever span is current."""
        return Context()

    @staticmethod
    def use(span: Span):
        """Make ``span`` the current one (for spans started under it) without ending it."""
        return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    # ---- spans -------------------------------------------------------------------------
    def start(self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
              attributes: dict[str, Any] | None = None, start_ns: int | None = None) -> Span:
        """A span under ``parent`` (None: the current context)."""
        return self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_ns)

    def interval(self, name: str, parent: Context | None, start_ns: int, end_ns: int,
                 attributes: dict[str, Any] | None = None, error: bool = False) -> Span:
        """A span of something that is already over (a stage measured by the pipeline, a queue wait)."""
        span = self.tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=max(start_ns, end_ns))
        return span

    @staticmethod
    def failed(span: Span, description: str | None = None) -> None:
        span.set_status(Status(StatusCode.ERROR, description))

    def middleware(self):
        from services.runtime.traces.middleware import TraceMiddleware
        return TraceMiddleware

    # ---- the end -----------------------------------------------------------------------
    def shutdown(self, timeout_s: float = STOP_FLUSH_S) -> None:
        """Send what is queued, waiting at most ``timeout_s``: an unreachable collector must not
        hold up the drain (the processor's thread is a daemon: it never holds up the exit)."""
        worker = threading.Thread(target=self.provider.shutdown, name="onecard-traces-stop", daemon=True)
        worker.start()
        worker.join(timeout_s)


def exporters_from_environment(environ: Mapping[str, str]) -> list[SpanExporter]:
    """OTEL_TRACES_EXPORTER's exporters (default otlp: OTLP over HTTP/protobuf, whose endpoint,
    headers, timeout and TLS the exporter reads from OTEL_EXPORTER_OTLP_* itself)."""
    out: list[SpanExporter] = []
    for name in exporter_names(environ) or ["otlp"]:
        if name == "none":
            continue
        if name == "console":
            out.append(ConsoleSpanExporter())
        elif name in ("otlp", "otlp_proto_http"):
            protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                        or "http/protobuf").strip().lower()
            if protocol == "grpc" and (grpc := _entry_point_exporter("otlp_proto_grpc")) is not None:
                out.append(grpc)
                continue
            if protocol != "http/protobuf":
                log.warning("traces: OTLP protocol %r is not available here; spans are sent over http/protobuf "
                            "(the protocol onecard[otel] installs)", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            out.append(OTLPSpanExporter())
        else:
            exporter = _entry_point_exporter(name)
            if exporter is None:
                log.warning("traces: no span exporter named %r is installed; it is ignored", name)
            else:
                out.append(exporter)
    return out


def _entry_point_exporter(name: str) -> SpanExporter | None:
    from importlib.metadata import entry_points
    for ep in entry_points(group="opentelemetry_traces_exporter", name=name):
        return ep.load()()
    return None


def resource_for(service: str, environ: Mapping[str, str], version: str) -> Resource:
    """service.name onecard-<service> unless OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES) names
    it; the service and its unit as attributes of their own, so that a fleet's traces can be cut
    by either."""
    unit = unit_name(environ)
    ours: dict[str, Any] = {
        "service.name": default_service_name(service),
        "service.namespace": "onecard",
        "service.instance.id": environ.get("ONECARD_INSTANCE_TOKEN") or f"{unit}-{os.getpid()}",
        "onecard.service": service,
        "onecard.unit": unit,
        "host.name": unit,
    }
    if version:
        ours["service.version"] = version
    # what the operator set wins over our defaults (Resource.create would let ours win)
    ours.update(OTELResourceDetector().detect().attributes)
    if environ.get("OTEL_SERVICE_NAME", "").strip():
        ours["service.name"] = environ["OTEL_SERVICE_NAME"].strip()
    return Resource.create(ours)


def build_from_environment(service: str, environ: Mapping[str, str], version: str = "") -> Traces | None:
    global _global_set
    exporters = exporters_from_environment(environ)
    if not exporters:
        log.warning("traces: OTEL_* variables ask for traces but name no usable exporter; this service runs "
                    "without traces")
        return None
    provider = TracerProvider(resource=resource_for(service, environ, version))  # sampler: OTEL_TRACES_SAMPLER
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* size and pace it
    if not _global_set:  # the service's own code may trace with opentelemetry.trace.get_tracer()
        trace.set_tracer_provider(provider)
        _global_set = True
    return Traces(provider, version)

"""OpenTelemetry traces for every service, off unless the standard OTEL_* variables ask for
them (docs/traces.md).

Off (the default), nothing of opentelemetry is imported and a request pays one context
variable lookup. On, the shell puts a server span around every request (behind the edge's
limits and the credential check), the pipeline's stages become its child spans, and the
jobs service carries a job's trace context from its submit to the service call.

The modules that import opentelemetry (tracer, middleware) are only imported once traces
are wanted (setup.traces_from_environment); config and stages never import it.
"""

"""A job's trace: its submit, each run's wait in the queue, each attempt, and the call to the
service, all in the trace of the submit.

The submit span's context is kept with the job (record fields ``traceparent`` and
``tracestate``), so that the consumer that runs it, on this unit or another, continues the
same trace; the attempt's context goes to the service as ``traceparent``, which makes the
service's request span a child of the attempt. A job whose record has no trace context
(submitted while traces were off) gets a trace of its own per run, rooted at the attempt.

Only called when the service has traces (``Traces`` from services.runtime.traces).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from services.jobs.records import Delivery
from services.runtime.errors import ApiError

if TYPE_CHECKING:
    from services.runtime.traces.tracer import Traces

# how an attempt ended, as the consumer counts it; these mean the attempt itself failed
FAILED_OUTCOMES = frozenset({"failed", "dead_lettered", "retried"})


@contextmanager
def submit_span(traces: Traces):
    """The submit (checks, the service's dry run, the queueing), under the request's span; an
    error status only for a failure of ours (5xx)."""
    span = traces.start("job submit")
    try:
        with traces.use(span):
            yield span
    except ApiError as exc:
        span.set_attribute("onecard.job.refused", exc.code)
        if exc.status >= 500:
            traces.failed(span, exc.code)
        raise
    except Exception as exc:
        span.record_exception(exc)
        traces.failed(span, type(exc).__name__)
        raise
    finally:
        span.end()


def described(span: Any, service: str, route: str, model: str, priority: str) -> None:
    span.set_attributes({"onecard.job.service": service, "onecard.job.route": route, "onecard.job.model": model,
                         "onecard.job.priority": priority})


def submitted(span: Any, job_id: str, created: bool) -> None:
    span.set_attribute("onecard.job.id", job_id)
    span.set_attribute("onecard.job.replayed", not created)  # an Idempotency-Key replay: the first submit's trace


class AttemptTrace:
    """One run of a job: its queue wait (a span of the past) and the attempt span, open until
    the run ends."""

    def __init__(self, traces: Traces, d: Delivery, node: str):
        self.traces = traces
        parent = traces.extract(d.trace) if d.trace else None
        attrs = {"onecard.job.id": d.job_id, "onecard.job.model": d.label, "onecard.job.route": d.route,
                 "onecard.job.attempt": d.attempt, "onecard.job.run": d.runs, "onecard.node": node}
        if d.isolate:
            attrs["onecard.job.isolated"] = True
        if parent is None:  # no trace to continue: this run's own, rooted at the attempt
            parent = traces.new_trace()
        self.span = traces.start("job attempt", parent, attributes=attrs)
        if d.queued_at is not None and d.started_at is not None:
            wait_parent = traces.context_of(self.span) if not d.trace else parent
            traces.interval("job queue wait", wait_parent, int(d.queued_at * 1e9), int(d.started_at * 1e9),
                            {"onecard.job.id": d.job_id, "onecard.job.model": d.label,
                             "onecard.job.attempt": d.attempt})
        self.outcome: str | None = None
        self.error: str | None = None

    def headers(self) -> dict[str, str]:
        """What the call to the service carries: this attempt as the parent of its request span."""
        return self.traces.carrier_of(self.span)

    def ended(self, outcome: str, error: dict[str, Any] | None = None) -> None:
        if self.outcome is None:  # the first write of the run says how it ended
            self.outcome = outcome
            self.error = (error or {}).get("code") if isinstance(error, dict) else None

    def end(self, exc: BaseException | None = None) -> None:
        outcome = self.outcome or ("interrupted" if exc is not None else "unknown")
        self.span.set_attribute("onecard.job.outcome", outcome)
        if self.error:
            self.span.set_attribute("error.type", str(self.error)[:100])
        if exc is not None and isinstance(exc, Exception):
            self.span.record_exception(exc)
        if outcome in FAILED_OUTCOMES:
            self.traces.failed(self.span, self.error or outcome)
        self.span.end()

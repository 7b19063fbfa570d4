"""A job's attempts in its trace, on the embedded queue and on Redis (whose job record keeps
the submit's traceparent as a field of its own): every run has a queue-wait span and an
attempt span under the submit, the attempt says its number and how it ended (retried,
dead-lettered, succeeded), a failed attempt has an error status, and the call to the
service carries the attempt's traceparent. The service here is the scripted jobs target
(tests/children/jobs_target.py), which records the traceparent each call brought. (Records
written without trace fields: tests/integration/test_jobs_broker.py.)"""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from tests.jobs_harness import TARGET_APP, Unit, start_units
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.redis_server import RedisServer

ERROR = 2  # OTLP's status code


def _otel_env(endpoint: str) -> dict[str, str]:
    return {**{k: "" for k in os.environ if k.startswith("OTEL_")},
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _job_trace(spans: list[ReceivedSpan], job_id: str) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    submit = next(s for s in spans if s.name == "job submit" and s.attributes.get("onecard.job.id") == job_id)
    return submit, [s for s in spans if s.trace_id == submit.trace_id]


def _attempts(trace: list[ReceivedSpan]) -> dict[int, ReceivedSpan]:
    runs = [s for s in trace if s.name == "job attempt"]
    return {s.attributes["onecard.job.attempt"]: s for s in runs}


@pytest.mark.parametrize("queue", ["embedded", "redis"])
def test_every_attempt_is_a_span_with_its_outcome_and_parents_its_service_call(tmp_path, queue):
    with OtlpReceiver() as receiver, \
            (RedisServer(tmp_path) if queue == "redis" else contextlib.nullcontext()) as server:
        settings = {"max_attempts": 2, "retry_backoff_s": 0, "retry_jitter": 0}
        if server is not None:
            settings.update(url=server.url, prefix="traced")
        unit = Unit(tmp_path, "traced", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True})}, queue=settings)
        unit.jobs.env.update(_otel_env(receiver.endpoint))
        try:
            start_units(unit)
            flaky = unit.submit("scripted", "/api/v1/work", params={"tag": "flaky", "status": 500, "times": 1})
            broken = unit.submit("scripted", "/api/v1/work", params={"tag": "broken", "status": 500})
            assert unit.wait(flaky["id"])["state"] == "succeeded"
            dead = unit.wait(broken["id"])
            assert dead["state"] == "failed" and dead["dead_lettered"], dead

            def complete(spans: list[ReceivedSpan]) -> bool:
                outcomes = [s.attributes.get("onecard.job.outcome") for s in spans if s.name == "job attempt"]
                return outcomes.count("retried") >= 2 and {"succeeded", "dead_lettered"} <= set(outcomes)
            spans = receiver.wait_for(complete, 60, "four attempts")
            calls = json.loads(json.dumps(unit.calls("scripted")["traceparents"]))
        finally:
            unit.stop()

    sent = {tag: [] for tag, _ in calls}
    for tag, traceparent in calls:
        sent[tag].append(traceparent)
    for job, tag, last in ((flaky, "flaky", "succeeded"), (broken, "broken", "dead_lettered")):
        submit, trace = _job_trace(spans, job["id"])
        attempts = _attempts(trace)
        assert set(attempts) == {1, 2}, trace
        assert attempts[1].attributes["onecard.job.outcome"] == "retried" and attempts[1].status == ERROR
        assert attempts[2].attributes["onecard.job.outcome"] == last
        assert (attempts[2].status == ERROR) == (last == "dead_lettered")
        waits = [s for s in trace if s.name == "job queue wait"]
        assert len(waits) == 2
        for span in (*attempts.values(), *waits):
            assert span.parent_id == submit.span_id and span.attributes["onecard.job.id"] == job["id"]
        # each call to the service carried its own attempt as the parent, in order
        parsed = [traceparent.split("-") for traceparent in sent[tag]]
        assert [(trace_id, span_id) for _, trace_id, span_id, _ in parsed] == \
            [(submit.trace_id, attempts[n].span_id) for n in (1, 2)], (sent, attempts)
        assert all(int(flags, 16) & 1 for *_, flags in parsed)  # sampled: the service records its span

"""Counters of the HTTP edge that services.runtime.shell.metrics does not list: send deadlines,
pipelining and framing refusals, connections evicted at the limit, bodies too slow or in tiny
chunks, sockets reset with an unread answer, credential failures.
Registered by services.runtime.serve on the service's registry; every figure is a plain
int written on the event loop and read here (in the probe thread too) without a lock."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EdgeCollector:
    def __init__(self, stats, limiter, linger, bodies=None):
        self.stats, self.limiter, self.linger, self.bodies = stats, limiter, linger, bodies

    def collect(self):
        for name, value, text in (
                ("onecard_send_timeouts", self.stats.send_timeouts,
                 "Connections reset because the client took none of its answer for send_timeout_s."),
                ("onecard_pipelined_requests_refused", self.stats.pipeline_refused,
                 "Requests refused (429) beyond max_pipelined_requests on one connection."),
                ("onecard_request_framing_too_large", self.stats.framing_too_large,
                 "Requests whose body framing took over twice max_body_bytes on the wire (413)."),
                ("onecard_connections_evicted", self.stats.evicted,
                 "Idle connections (or unfinished heads, or stalled bodies) closed to make room at max_connections."),
                ("onecard_connections_taken_late", self.stats.taken_late,
                 "Newcomers refused at max_connections whose whole request arrived while their 503 waited, "
                 "then taken beyond the limit after all."),
                ("onecard_probes_answered_at_the_door", self.stats.probes_at_the_door,
                 "GET /healthz of newcomers refused at max_connections, answered at once without a place."),
                ("onecard_probes_answered_at_accept", self.stats.probes_at_accept,
                 "GET /healthz answered the moment its connection was accepted, ahead of the others."),
                ("onecard_connections_gone_at_accept", self.stats.gone_at_accept,
                 "Connections their client reset, closed without a byte, or closed after a whole request, "
                 "before they were taken: closed at once (and half requests so closed, past 64 waiting)."),
                ("onecard_bodies_too_slow", self.stats.bodies_too_slow,
                 "Request bodies cut for arriving under min_body_rate_bytes_s (408)."),
                ("onecard_bodies_too_fragmented", self.stats.bodies_too_fragmented,
                 "Chunked request bodies refused for chunks averaging under min_body_chunk_bytes (413)."),
                ("onecard_upload_reads_deferred", self.stats.reads_deferred,
                 "Upload reads put off to a later turn of the event loop, so that probes and small requests "
                 "come round between them."),
                ("onecard_request_starts_deferred", self.stats.starts_deferred,
                 "Requests whose app started in a later turn of the event loop (at most 8 start in one turn, "
                 "probes at once), so that probes come round between them."),
                ("onecard_unread_answers_reset", self.linger.reset_total,
                 "Closed connections reset because their answer stayed unread in the kernel."),
                ("onecard_auth_failures", self.limiter.failures_total,
                 "Requests that presented a credential and were answered 401."),
                ("onecard_auth_rate_limited", self.limiter.refused_total,
                 "Requests refused (429) because their address failed auth_max_failures times.")):
            fam = CounterMetricFamily(name, text)
            fam.add_metric([], value)
            yield fam
        if self.bodies is not None:
            fam = CounterMetricFamily("onecard_heap_trims_after_uploads",
                                      "Heap given back to the kernel once a burst of request bodies (64 MiB or more "
                                      "read at once) was over.")
            fam.add_metric([], self.bodies.trims)
            yield fam
        gauge = GaugeMetricFamily("onecard_unread_answer_sockets",
                                  "Closed connections whose answer is still draining from the kernel.")
        gauge.add_metric([], self.linger.count)
        yield gauge

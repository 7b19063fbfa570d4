"""What the guarded protocol (services.runtime.edge.protocol) enforces and counts: the limits,
built from a service's settings, its counters, and the bytes of an error it writes
itself (before or without the app)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512
    max_header_bytes: int = 16 * 1024
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    connection_queue_timeout_s: float = 4.0
    send_buffer_bytes: int = 256 * 1024
    max_pipelined_requests: int = 16
    max_body_bytes: int = 20 * 2**20
    min_body_rate_bytes_s: int = 64 * 1024
    body_rate_grace_s: float = 5.0
    min_body_chunk_bytes: int = 1024
    lingering_drain_bytes_s: int = 256 * 2**20

    @property
    def max_body_framing_bytes(self) -> int:
        """Raw bytes one request body may take on the wire, framing included."""
        return 2 * self.max_body_bytes + 64 * 1024


class ConnectionStats:
    """Counters the service shows in /metrics (written on the event loop only)."""
    refused = 0
    timed_out = 0
    headers_too_large = 0
    bad_requests = 0
    send_timeouts = 0
    pipeline_refused = 0
    framing_too_large = 0
    evicted = 0
    bodies_too_slow = 0
    bodies_too_fragmented = 0
    probes_at_the_door = 0    # GET /healthz of refused newcomers answered without a place
    probes_at_accept = 0      # GET /healthz answered the moment its connection was accepted (door)
    gone_at_accept = 0        # connections reset, or closed with no whole request, before they were accepted
    taken_late = 0            # refused newcomers whose whole request came while their 503 waited
    starts_deferred = 0       # requests whose app started in a later turn of the loop (start_turns)
    reads_deferred = 0        # paused uploads whose next read waited for a later turn (read_turns)


class Refusal(Exception):
    """Raised from a parser callback: stop parsing, answer ``status`` (after earlier answers),
    count it in ``ConnectionStats.<counter>``."""

    def __init__(self, status: int, code: str, message: str, counter: str):
        super().__init__(message)
        self.status, self.code, self.message, self.counter = status, code, message, counter


def error_bytes(status: int, code: str, message: str, extra_headers: bytes = b"") -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (STATUS_LINE[status] + b"content-type: application/json\r\n"
            + b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n"
            + extra_headers + b"\r\n" + body)


def limits_from_settings(settings, fds: int) -> ConnectionLimits:
    """The limits from a service's settings (any object with the keys; a missing key keeps
    its default, so a service with its own settings model gets them all)."""
    defaults = ConnectionLimits()
    values = {name: getattr(settings, name, getattr(defaults, name))
              for name in ConnectionLimits.__dataclass_fields__}
    # open connections (and the eighth beyond them that whole requests may take, and the
    # probes' reserve), up to four times as many refusals waiting or lingering, twice as many
    # connections told after making room, as many lingering closes and as many unread answers
    # draining from the kernel must all fit under the descriptor limit
    values["max_connections"] = min(values["max_connections"], max(16, (fds - 80) // 10))
    return ConnectionLimits(**values)

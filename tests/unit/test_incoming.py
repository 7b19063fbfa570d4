"""What the batching policy is told is coming, replayed with a scripted clock: requests still
decoding, and closed-loop clients that come back on their connection after their answer."""

from __future__ import annotations

import pytest

from services.runtime.pipeline.incoming import Incoming


def closed_loop(incoming: Incoming, connections: int, rounds: int, gap: float = 0.002) -> float:
    """`connections` clients, each sending again `gap` s after its answer, for `rounds` rounds."""
    t = 0.0
    for _ in range(rounds):
        for c in range(connections):
            req = object()
            incoming.arrived(("10.0.0.1", 5000 + c), t)
            incoming.decoding(req, t)
            incoming.decoded(req, t + 0.004)
            incoming.answering(req, t + 0.5)
            incoming.answered(req, ("10.0.0.1", 5000 + c), t + 0.52)
        t += 0.52 + gap
    return t


def test_requests_decoding_are_expected_when_a_decode_usually_ends():
    incoming = Incoming()
    a, b = object(), object()
    incoming.decoding(a, 0.0)
    incoming.decoded(a, 0.010)
    incoming.decoding(b, 1.0)
    assert incoming.etas(1.004) == [pytest.approx(0.006)]
    assert incoming.etas(1.5) == [pytest.approx(0.001)]  # overdue: any moment now


def test_answers_in_progress_count_when_clients_come_back_on_their_connection():
    incoming = Incoming()
    t = closed_loop(incoming, 4, 5)
    assert incoming.returning_share(t) == 1.0 and incoming.gap_s == pytest.approx(0.002)
    straggler = object()
    incoming.answering(straggler, t)
    etas = incoming.etas(t + 0.005)
    # its answer usually takes 20 ms, then 2 ms to come back, then 4 ms of decode
    assert etas == [pytest.approx(0.015 + 0.002 + 0.004)]


def test_clients_that_do_not_come_back_make_answers_in_progress_count_for_nothing():
    incoming = Incoming()
    t = 0.0
    for n in range(20):  # a new connection for every request (no keep-alive): nothing returns
        req = object()
        incoming.arrived(("10.0.0.1", 6000 + n), t)
        incoming.answering(req, t + 0.1)
        incoming.answered(req, ("10.0.0.1", 6000 + n), t + 0.12)
        t += 0.5
    incoming.answering(object(), t)
    assert incoming.returning_share(t + 5) == 0.0 and incoming.etas(t) == []


def test_a_connection_that_comes_back_late_is_not_a_closed_loop_client():
    incoming = Incoming()
    for n in range(10):
        req = object()
        incoming.answering(req, n * 10.0)
        incoming.answered(req, "c", n * 10.0 + 0.01)
        incoming.arrived("c", n * 10.0 + 5.0)  # five seconds later: someone thinking, not a loop
    assert incoming.returning_share(200.0) == 0.0 and incoming.gap_s is None


def test_a_decode_waiting_for_memory_is_not_expected_and_its_wait_is_not_decode_time():
    """It cannot reach the queue before the requests holding the memory run: a policy that
    waited for it would hold the queued ones back for nothing (6 requests, 10 s instead of 1.2)."""
    inc = Incoming()
    inc.decoding("a", 0.0)
    inc.decoded("a", 0.010)   # a usual decode: 10 ms
    inc.decoding("b", 1.0)
    inc.decode_paused("b", 1.004)
    assert inc.etas(1.005) == []
    inc.decode_resumed("b", 3.0)
    assert inc.etas(3.0) == [pytest.approx(0.006)]  # 4 ms done of a 10 ms decode
    inc.decoded("b", 3.006)
    assert inc.decode_s == pytest.approx(0.010)     # the 2 s of waiting are not decode time

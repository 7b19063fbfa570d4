"""The auto batching policy's decisions on scripted arrivals, with its own clock: when the
model frees up with k items waiting, does it run now or wait, and for how long? No timing
in these tests: every instant is an argument."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.runtime.pipeline.batch_policy import BatchPolicy
from services.runtime.pipeline.cost_curves import CURVE_WEIGHT_CAP, BatchCurve

SD = (0.643, 0.0644)        # H100, SD-1.5 img2img fp16 512x512: A + B(b - 1)
DETECT = (0.008, 0.0015)
LINEAR = (0.2, 0.2)         # a CPU model: b items cost b times one


def curve(a: float, b: float, max_batch: int = 8) -> BatchCurve:
    c = BatchCurve(max_batch)
    for size in (1, 2, 4, max_batch):
        c.replace(size, a + b * (size - 1))
    return c


def seconds_of(c: BatchCurve):
    return lambda n: c.seconds(n)


def closed_loop(policy: BatchPolicy, clients_back: int, back_after: float, cycle: float, cycles: int = 20,
                key="k") -> float:
    """Replay `cycles` model-free moments, each followed by `clients_back` arrivals `back_after`
    seconds later (closed-loop clients coming back with their next request). Returns the
    time of the last model-free moment plus one cycle (the "now" of the next decision)."""
    t = 100.0
    for _ in range(cycles):
        policy.history.model_freed(t)
        policy.history.arrived(t + back_after, clients_back, key)
        t += cycle
    policy.history.model_freed(t)
    return t


def test_a_model_whose_cost_grows_linearly_never_waits_whatever_is_coming():
    c = curve(*LINEAR)
    policy = BatchPolicy(8, None)
    t = closed_loop(policy, 4, 0.002, 0.8)
    d = policy.decide(t, 1, "k", 0.0, 0.0, [0.001, 0.001, 0.002], seconds_of(c))
    assert d.wait_s == 0.0


@pytest.mark.parametrize("profile", [SD, DETECT])
def test_closed_loop_clients_coming_back_after_their_answers_are_waited_for(profile):
    """4 clients, batches of 2 alternating: the model frees with 2 waiting, and the 2 whose
    answers just went out come back 15 ms later. One call of 4 beats two calls of 2."""
    c = curve(*profile)
    policy = BatchPolicy(8, None)
    back = min(0.015, profile[0] / 4)
    t = closed_loop(policy, 2, back, profile[0] + profile[1])
    d = policy.decide(t, 2, "k", 0.0, 0.0, [], seconds_of(c))
    assert d.wait_s == pytest.approx(back, abs=0.001)
    assert d.expected_items == pytest.approx(4)


def test_a_lone_client_never_waits():
    """One client: the model frees, and its next request arrives 10 ms later. When it arrives
    nothing else ever followed at this point, so it runs at once."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    t = closed_loop(policy, 1, 0.010, 0.7)
    policy.history.arrived(t + 0.010, 1, "k")  # the scheduler records an arrival before it decides
    d = policy.decide(t + 0.010, 1, "k", 0.010, 0.0, [], seconds_of(c))
    assert d.wait_s == 0.0


def test_requests_still_decoding_are_waited_for_when_they_will_be_ready_soon():
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    d = policy.decide(10.0, 1, "k", 0.0, 0.0, [0.004, 0.006, 0.005], seconds_of(c))
    assert d.wait_s == pytest.approx(0.006, abs=0.0005)
    assert d.expected_items == pytest.approx(4)


def test_decoding_requests_far_away_are_not_worth_waiting_for():
    """Waiting 640 ms for one more item costs more per item than running now."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    d = policy.decide(10.0, 3, "k", 0.0, 0.0, [0.640], seconds_of(c))
    assert d.wait_s == 0.0


def test_a_full_batch_and_an_unknown_curve_never_wait():
    c = curve(*SD)
    policy = BatchPolicy(4, None)
    assert policy.decide(10.0, 4, "k", 0.0, 0.0, [0.001], seconds_of(c)).wait_s == 0.0
    assert policy.decide(10.0, 1, "k", 0.0, 0.0, [0.001], lambda n: None).wait_s == 0.0


def test_the_cap_bounds_the_oldest_items_wait():
    c = curve(*SD)
    assert BatchPolicy(8, 0.0).decide(10.0, 1, "k", 0.0, 0.0, [0.004], seconds_of(c)).wait_s == 0.0
    capped = BatchPolicy(8, 0.010)
    assert capped.decide(10.0, 1, "k", 0.0, 0.0, [0.004], seconds_of(c)).wait_s == pytest.approx(0.004, abs=1e-4)
    assert capped.decide(10.0, 1, "k", 0.0, 0.009, [0.004], seconds_of(c)).wait_s == 0.0  # 9 ms already
    auto = BatchPolicy(8, None)   # default cap: one call's fixed cost
    assert auto.cap(seconds_of(c)) == pytest.approx(SD[0])
    assert auto.decide(10.0, 1, "k", 0.0, SD[0], [0.004], seconds_of(c)).wait_s == 0.0


def test_a_client_that_already_came_back_is_not_expected_again():
    """Two clients came back 10-20 ms after each model-free moment; this time both are here
    by 20 ms: nothing more is expected, however the phases jitter."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    t = 100.0
    for n in range(30):
        policy.history.model_freed(t)
        policy.history.arrived(t + 0.010 + 0.001 * (n % 3), 1, "k")
        policy.history.arrived(t + 0.018 + 0.001 * (n % 3), 1, "k")
        t += 0.75
    policy.history.model_freed(t)
    policy.history.arrived(t + 0.009, 1, "k")
    assert policy.decide(t + 0.009, 1, "k", 0.009, 0.0, [], seconds_of(c)).wait_s > 0  # the other is coming
    policy.history.arrived(t + 0.012, 1, "k")
    assert policy.decide(t + 0.012, 2, "k", 0.012, 0.003, [], seconds_of(c)).wait_s == 0.0


def test_a_new_load_pattern_is_learnt_within_a_few_cycles():
    """From one client to four (the model frees with 2 waiting, 2 come back 15 ms later):
    after a handful of cycles of the new pattern the policy waits for them."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    t = closed_loop(policy, 1, 0.015, 0.7, cycles=40)
    t = closed_loop_from(policy, t, 2, 0.015, 0.71, cycles=6)
    d = policy.decide(t, 2, "k", 0.0, 0.0, [], seconds_of(c))
    assert d.wait_s == pytest.approx(0.015, abs=0.001)


def closed_loop_from(policy: BatchPolicy, t: float, back: int, after: float, cycle: float, cycles: int) -> float:
    for _ in range(cycles):
        policy.history.arrived(t + after, back, "k")
        t += cycle
        policy.history.model_freed(t)
    return t


def test_arrivals_that_cannot_join_the_head_are_not_waited_for():
    """Every recent arrival had another batching key (another size): waiting gains nothing."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    t = closed_loop(policy, 2, 0.010, 0.7, key="other")
    d = policy.decide(t, 2, "k", 0.0, 0.0, [], seconds_of(c))
    assert d.wait_s == 0.0


def test_a_steady_stream_is_waited_for_when_busy_and_not_when_light():
    """Open-loop arrivals with no relation to the model: at 40 a second a call of 1 at
    643 ms would be hopeless, so it waits for company; at 0.5 a second it runs at once."""
    c = curve(*SD)
    for rate, waits in ((40.0, True), (0.5, False)):
        policy = BatchPolicy(8, None)
        t = 100.0
        for n in range(int(rate * 30)):
            policy.history.arrived(t + n / rate, 1, "k")
        for n in range(40):
            policy.history.model_freed(t + n * 0.7)
        now = t + 30.0 + 1.0
        policy.history.model_freed(now)
        d = policy.decide(now, 1, "k", 0.0, 0.0, [], seconds_of(c))
        assert (d.wait_s > 0) is waits, (rate, d)


def test_the_last_client_of_a_full_call_is_waited_for_even_when_calls_alternated():
    """8 closed-loop clients, max 8: calls of 8 and 7 have been alternating (the 8th came back
    a little late and went into the next call). After a call of 8, the 8th usually comes back
    by 78 ms; cycles after a call of 7 had only 7 to come back and say nothing about an 8th.
    At 62 ms, with 7 here, the policy waits for the 8th."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    t = 100.0
    for n in range(24):
        size = 8 if n % 2 else 7
        policy.history.model_freed(t, size)
        for i in range(size):
            policy.history.arrived(t + 0.030 + 0.0065 * i + 0.001 * (n % 3), 1, "k")
        t += 1.2
    policy.history.model_freed(t, 8)
    for i in range(7):
        policy.history.arrived(t + 0.030 + 0.0065 * i, 1, "k")
    d = policy.decide(t + 0.062, 7, "k", 0.062, 0.032, [], seconds_of(c))
    assert 0.010 < d.wait_s < 0.020, d


def test_long_after_the_model_freed_up_past_cycles_say_nothing():
    """Requests used to come in bursts of four, 2 s apart: after each free moment, three more
    followed 2 s later. A lone request arriving 2 s after the model freed up must not wait for
    the next burst on that evidence: that long after, the cycle is over."""
    c = curve(*SD)
    policy = BatchPolicy(8, None)
    t = 100.0
    for _ in range(20):
        policy.history.model_freed(t, 4)
        policy.history.arrived(t + 2.0, 1, "k")
        policy.history.arrived(t + 2.3, 3, "k")
        t += 3.0
    policy.history.model_freed(t, 4)
    policy.history.arrived(t + 2.0, 1, "k")
    assert policy.decide(t + 2.0, 1, "k", 2.0, 0.0, [], seconds_of(c)).wait_s == 0.0


def test_one_slow_call_of_a_rare_size_does_not_make_full_batches_look_dear():
    """The H200 run: warm-up measured 1, 2, 4, 8 at 561, 492, 731, 1160 ms, the live calls
    were mostly 4s, and one call of 7 took 1470 ms. Lifting every bigger size to that one call
    made 8 cost more than two calls of 4; 8 clients then ran as two halves for good. Pooled
    with its neighbours, a call of 8 stays the bargain it is, and the policy waits for the
    half whose answers just went out."""
    c = BatchCurve(8)
    for size, ms in ((1, 561), (2, 492), (4, 731), (8, 1160)):
        c.replace(size, ms / 1000)
    for _ in range(12):
        c.observe(4, 0.731)
    c.observe(8, 1.16)
    c.observe(7, 1.47)
    assert c.seconds(8) < 2 * c.seconds(4)
    assert all(c.seconds(n) <= c.seconds(n + 1) for n in range(1, 8))
    policy = BatchPolicy(8, None)
    t = closed_loop(policy, 4, 0.03, 0.76)
    d = policy.decide(t, 4, "k", 0.0, 0.0, [], seconds_of(c))
    assert d.wait_s == pytest.approx(0.03, abs=0.002) and d.expected_items == pytest.approx(8)


def _isotonic_reference(ys: list[float], ws: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit by its min-max formula (no pooling):
    fit_i = max over j <= i of min over k >= i of the weighted mean of ys[j..k]."""
    def mean(j, k):
        return sum(y * w for y, w in zip(ys[j:k + 1], ws[j:k + 1], strict=True)) / sum(ws[j:k + 1])
    n = len(ys)
    return [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.floats(0.001, 5.0), st.integers(1, 40)),
                min_size=1, max_size=9, unique_by=lambda p: p[0]))
def test_the_curve_is_the_weighted_monotone_least_squares_fit_of_the_measured_sizes(points):
    """Weights are the calls per size, capped; the fit is non-decreasing, equals the input
    when that already is, and matches the reference fit."""
    c = BatchCurve(64)
    for size, secs, calls in points:
        c.replace(size, secs)
        c._counts[size] = calls
    ordered = sorted(points)
    ys = [secs for _, secs, _ in ordered]
    ws = [min(calls, CURVE_WEIGHT_CAP) for _, _, calls in ordered]
    fit = c._monotone()
    assert [s for s, _ in fit] == [s for s, _, _ in ordered]
    values = [v for _, v in fit]
    assert all(a <= b for a, b in zip(values, values[1:], strict=False))
    assert values == pytest.approx(_isotonic_reference(ys, ws), rel=1e-9, abs=1e-12)
    if all(a <= b for a, b in zip(ys, ys[1:], strict=False)):
        assert values == ys

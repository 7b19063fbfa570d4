"""The credential-failure limiter's rules, on an injected clock: a sliding window per
address, the wait it announces, and a bounded table."""

from __future__ import annotations

from services.runtime.edge.auth_failures import FailureLimiter
from services.runtime.edge.credentials import Credentials


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_limited_after_max_failures_until_the_oldest_leaves_the_window():
    clock = Clock()
    lim = FailureLimiter(3, 10.0, clock=clock)
    for _ in range(3):
        assert lim.retry_after("a") is None
        lim.record_failure("a")
        clock.now += 1
    assert lim.retry_after("a") == 7.0  # the first failure (t=1000) leaves at t=1010; now 1003
    assert lim.retry_after("b") is None
    clock.now = 1010.0
    assert lim.retry_after("a") is None
    lim.record_failure("a")  # the window now holds 1001, 1002 and 1010
    assert lim.retry_after("a") == 1.0


def test_zero_max_failures_turns_the_limit_off_but_failures_are_still_counted():
    lim = FailureLimiter(0, 10.0, clock=Clock())
    for _ in range(100):
        lim.record_failure("a")
    assert lim.retry_after("a") is None and lim.failures_total == 100 and not lim.enabled


def test_the_table_forgets_the_least_recently_failed_address_first():
    clock = Clock()
    lim = FailureLimiter(1, 60.0, clock=clock, max_clients=3)
    for address in ("a", "b", "c"):
        lim.record_failure(address)
    lim.record_failure("a")  # a is now the most recent
    lim.record_failure("d")  # over 3: b goes
    assert lim.retry_after("b") is None
    assert all(lim.retry_after(x) is not None for x in ("a", "c", "d"))


def _scope(*headers: tuple[bytes, bytes]) -> dict:
    return {"headers": list(headers)}


def test_credentials_accept_exactly_one_right_credential():
    creds = Credentials(b"key", [(b"alice", b"pw")])
    assert creds.check(_scope((b"x-api-key", b"key")))
    assert creds.check(_scope((b"authorization", b"Bearer key")))
    assert creds.check(_scope((b"authorization", b"Basic YWxpY2U6cHc=")))
    assert not creds.check(_scope())
    assert not creds.check(_scope((b"x-api-key", b"key"), (b"x-api-key", b"key")))
    assert not creds.check(_scope((b"x-api-key", b"nope"), (b"authorization", b"Bearer key")))
    assert not creds.check(_scope((b"x-api-key", b"nope, key")))
    assert not creds.check(_scope((b"authorization", b"Token key")))

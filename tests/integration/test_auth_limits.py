"""Credentials at the edge of a real service: one credential per request (never "any of
them matches"), failures counted, and an address that keeps failing answered 429 with
Retry-After until its failures leave the window. Each test speaks from its own client
address (X-Forwarded-For, which uvicorn trusts from 127.0.0.1 only), since the limit
is per address."""

from __future__ import annotations

import base64
import itertools
import time

import httpx
import pytest

from tests.images import small_png
from tests.service_harness import ServiceProcess

APP = "tests.children.scripted_app:create_app"
KEY = "k-0123456789abcdef"
MAX_FAILURES = 5
WINDOW_S = 3.0
_addresses = (f"198.51.100.{n}" for n in itertools.count(1))


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    users = tmp / "users"
    users.write_text("alice:wonder-land\n")
    settings = {"api_key": KEY, "basic_auth_file": str(users), "auth_max_failures": MAX_FAILURES,
                "auth_failure_window_s": WINDOW_S}
    with ServiceProcess(APP, settings, tmp) as s:
        yield s


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def post(svc, headers: list[tuple[str, str]], address: str) -> httpx.Response:
    return httpx.post(svc.url + "/api/v1/echo", content=small_png(), timeout=30,
                      headers=[("content-type", "image/png"), ("x-forwarded-for", address), *headers])


def metric(svc, name: str) -> float:
    for line in httpx.get(svc.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


@pytest.mark.parametrize("headers", [
    [("x-api-key", "wrong"), ("x-api-key", KEY)],
    [("x-api-key", KEY), ("x-api-key", KEY)],
    [("authorization", "Bearer wrong"), ("authorization", f"Bearer {KEY}")],
    [("x-api-key", KEY), ("authorization", f"Bearer {KEY}")],
    [("authorization", basic("alice", "nope")), ("authorization", basic("alice", "wonder-land"))],
    [("x-api-key", f"wrong, {KEY}")],
    [("authorization", f"Bearer wrong, Bearer {KEY}")],
    [("authorization", f"Bearer wrong {KEY}")],
], ids=["two-keys", "same-key-twice", "two-bearers", "key-and-bearer", "two-basics", "key-list",
        "bearer-list", "bearer-words"])
def test_a_request_carries_one_credential_never_a_list_of_guesses(svc, headers):
    r = post(svc, headers, next(_addresses))
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("headers", [
    [("x-api-key", KEY)], [("authorization", f"Bearer {KEY}")], [("authorization", basic("alice", "wonder-land"))],
])
def test_one_right_credential_is_enough(svc, headers):
    assert post(svc, headers, next(_addresses)).status_code == 200


def test_an_address_that_keeps_failing_is_refused_with_retry_after_then_let_back(svc):
    me, other = next(_addresses), next(_addresses)
    failures_before = metric(svc, "onecard_auth_failures_total")
    for i in range(MAX_FAILURES):
        assert post(svc, [("x-api-key", f"guess-{i}")], me).status_code == 401
    locked = post(svc, [("x-api-key", KEY)], me)  # even the right key: a guess is not told apart
    assert locked.status_code == 429, locked.text
    assert locked.json()["error"]["code"] == "too_many_auth_failures" and locked.json()["detail"]
    retry_after = int(locked.headers["retry-after"])
    assert 1 <= retry_after <= WINDOW_S + 1
    assert post(svc, [("authorization", basic("alice", "wonder-land"))], me).status_code == 429
    # without a credential there is nothing to guess: the plain 401, not counted
    assert post(svc, [], me).status_code == 401
    # another address and the probes are not affected
    assert post(svc, [("x-api-key", KEY)], other).status_code == 200
    assert httpx.get(svc.url + "/healthz", headers={"x-forwarded-for": me, "x-api-key": "x"}).status_code == 200
    assert metric(svc, "onecard_auth_failures_total") - failures_before == MAX_FAILURES
    assert metric(svc, "onecard_auth_rate_limited_total") >= 2
    time.sleep(retry_after + 0.2)
    assert post(svc, [("x-api-key", KEY)], me).status_code == 200


def test_a_guess_per_request_is_all_an_address_gets(svc):
    """Hundreds of credential headers in one request cannot pass, and each such request
    counts as one failure."""
    me = next(_addresses)
    many = [("x-api-key", f"guess-{i}") for i in range(50)] + [("x-api-key", KEY)]
    for _ in range(MAX_FAILURES):
        assert post(svc, many, me).status_code == 401
    assert post(svc, [("x-api-key", KEY)], me).status_code == 429

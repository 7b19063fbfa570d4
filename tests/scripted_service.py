"""Driving the scripted service (tests/children/scripted_app.py) from a test: its echo route,
what its model saw, concurrent requests, waiting for a state, holding the model busy."""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from tests.images import small_png

APP = "tests.children.scripted_app:create_app"


PNG = {"content-type": "image/png"}


def post(svc, params="", body=None, headers=PNG, timeout=30.0, **kw):
    return httpx.post(f"{svc.url}/api/v1/echo{params}", content=small_png() if body is None else body,
                      headers=headers, timeout=timeout, **kw)


def seen(svc):
    return httpx.get(svc.url + "/seen").json()


def parallel(fns):
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(lambda f: f(), fns))


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


class Held:
    """The request holding the model: its answer (result), and release() to end the hold now."""

    def __init__(self, svc, fut: concurrent.futures.Future):
        self.svc, self.fut = svc, fut

    def release(self) -> None:
        httpx.post(self.svc.url + "/release", timeout=10)

    def result(self, timeout: float | None = None):
        return self.fut.result(timeout)


def hold_model(svc, seconds: float, rid: str = "blocker") -> Held:
    """Start a request that occupies the model, and wait until the model really has it.
    Hold it for longer than what the test queues behind it takes to arrive on a loaded
    2-core machine: the test asserts what the queue does while the model is busy. A test
    whose steps take turns with the queue holds it long and releases it when done."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(post, svc, f"?id={rid}&sleep={seconds}")
    wait_for(lambda: rid in seen(svc)["seen"], what=f"{rid} on the model")
    pool.shutdown(wait=False)
    return Held(svc, fut)


def answers_ready(svc) -> bool:
    try:
        return httpx.get(svc.url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

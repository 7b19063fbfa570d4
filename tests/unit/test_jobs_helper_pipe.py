"""Big submits and results are checked in helper processes, their bytes moved through pipes
(services.jobs.helper_pipe): no pickling of 30 MB with the GIL held. Real processes; every
one is stopped by the test that started it."""

from __future__ import annotations

import base64
import json
import os
import signal

import pytest

from services.jobs.helper_pipe import HelperGone, HelperPool
from services.jobs.payload import Limits, digest_submit
from tests.images import noisy_png, small_png

ARGS = {"max_depth": 32, "max_image_bytes": 20_000_000, "max_pixels": 40_000_000, "max_items": 10_000}


@pytest.fixture
def pool():
    p = HelperPool(2)
    try:
        yield p
    finally:
        p.close()


def _submits() -> list[bytes]:
    img = base64.b64encode(noisy_png(900, 700)).decode()
    return [
        json.dumps({"service": "detect", "route": "/api/v1/facedetect", "image": img,
                    "params": {"a": "é" * 10}}).encode(),
        json.dumps({"service": "img2img", "route": "/sdapi/v1/img2img", "body": {"init_images": [img, img]}}).encode(),
        json.dumps({"service": "detect", "route": "/api/v1/facedetect", "image": img[:-5] + "!!!!!"}).encode(),
        b'{"x": [' + b"[]," * 20_000 + b"[]]}",
        json.dumps({"service": "detect", "route": "/../etc", "image": base64.b64encode(small_png()).decode()}).encode(),
    ]


def test_a_helper_digests_a_submit_exactly_as_it_is_digested_here(pool):
    limits = Limits(ARGS["max_image_bytes"], ARGS["max_pixels"])
    for raw in _submits():
        head, body = pool.call("digest", ARGS, raw)
        here = digest_submit(raw, ARGS["max_depth"], limits, ARGS["max_items"])
        r = head["result"]
        assert body == here.body and type(body) is bytes
        assert (r["parsed"], r["service"], r["route"], r["sha"], [tuple(i) for i in r["images"]]) == \
            (here.parsed, here.service, here.route, here.sha, here.images)
        assert (tuple(r["error"]) if r["error"] else None) == here.error


def test_a_helper_that_dies_is_replaced(pool):
    pool.call("is_json", {}, b"[1]")
    helper = pool._idle[0]
    os.kill(helper.proc.pid, signal.SIGKILL)
    helper.proc.wait(5)
    with pytest.raises(HelperGone):
        pool.call("is_json", {}, b"[1]" * 1000)
    head, _ = pool.call("is_json", {}, json.dumps({"a": "b" * 3_000_000}).encode())
    assert head["result"]["is_json"] is True and pool._idle[0].proc.pid != helper.proc.pid


def test_a_helper_ends_when_its_pipe_closes(pool):
    pool.call("is_json", {}, b"{}")
    helper = pool._idle[0]
    helper.proc.stdin.close()
    assert helper.proc.wait(10) == 0
    pool._idle.clear()
    helper.kill()


def test_a_failing_call_is_said_and_the_helper_goes_on(pool):
    with pytest.raises(RuntimeError, match="KeyError"):
        pool.call("no such function", {}, b"")
    assert pool.call("is_json", {}, b"not json")[0]["result"]["is_json"] is False


def test_a_submit_with_a_megabyte_key_keeps_its_helper_and_a_short_message(pool):
    # the 422 names the unknown key: whole, its head was over the pipe's 1 MiB and the
    # helper was killed (and another started) at every such submit
    raw = json.dumps({"service": "detect", "route": "/api/v1/facedetect", "k" * 1_200_000: 1}).encode()
    head, _ = pool.call("digest", ARGS, raw)
    pid = pool._idle[0].proc.pid
    status, code, message = head["result"]["error"]
    assert (status, code) == (422, "invalid_parameter") and len(message) < 300 and "Extra inputs" in message
    assert pool.call("is_json", {}, b"[1]")[0]["result"]["is_json"] is True and pool._idle[0].proc.pid == pid


def test_a_call_that_fails_here_mid_frame_ends_its_helper(pool):
    import numpy as np
    pool.call("is_json", {}, b"[1]")
    helper = pool._idle[0]
    try:
        with pytest.raises(TypeError):   # data that cannot be sent (not contiguous)
            pool.call("is_json", {}, memoryview(np.zeros((4, 4), np.uint8)[:, ::2]))
        assert helper.proc.wait(10) is not None and pool._idle == []
    finally:
        helper.kill()


def test_a_helper_runs_below_the_event_loops_priority(pool):
    """A helper parses 30 MB submits at a lower priority than the jobs service's event loop:
    on a busy machine the loop (and its probes) gets a core first."""
    from services.runtime.device.threads import WORKER_NICENESS
    pool.call("is_json", {}, b"[1]")
    helper = pool._idle[0]
    with open(f"/proc/{helper.proc.pid}/stat") as fh:
        nice = int(fh.read().rsplit(")", 1)[1].split()[16])
    assert nice >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS)


def test_the_threads_that_move_big_submits_to_a_helper_run_below_the_event_loop(monkeypatch):
    """Writing 27 MB into a helper's pipe is the kernel's copy, charged to the thread that
    writes: it too yields to the loop and its probes."""
    import asyncio
    import threading

    from services.jobs.service import JobsService
    from services.jobs.settings import JobsSettings
    from services.runtime.device.threads import WORKER_NICENESS
    svc = JobsService("jobs", JobsSettings())
    seen: list[int] = []

    def call(fn, args, data):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        raise HelperGone("not started in this test")  # the service then checks it itself
    monkeypatch.setattr(svc.helpers, "call", call)
    try:
        assert asyncio.run(svc.is_json(b"[" + b"1," * 600_000 + b"1]")) is True
    finally:
        svc._helper_threads.shutdown(wait=True)
        svc.executor.shutdown(wait=True)
        svc.helpers.close()
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and seen[0] >= min(19, here + WORKER_NICENESS)


def test_the_jobs_cpu_work_runs_niced_and_in_the_gil_lane():
    """Listing pages and base64 pieces hold the GIL: they run one at a time (the lane the
    services' JSON work takes) on threads below the loop's priority, so that the loop competes
    with one such thread, not two (16 clients reading 500-job listings: jobs /healthz p99 122 ms
    with both at it, 87 ms through the lane)."""
    import asyncio
    import threading

    from services.jobs.service import JobsService
    from services.jobs.settings import JobsSettings
    from services.runtime.codecs.gil_lane import lane
    from services.runtime.device.threads import WORKER_NICENESS
    svc = JobsService("jobs", JobsSettings())

    def look() -> tuple[int, bool]:
        held = lane()._is_owned()  # the RLock's own check: held by this thread
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), held

    try:
        nice, in_lane = asyncio.run(svc.cpu(1 << 20, look))
    finally:
        svc._helper_threads.shutdown(wait=True)
        svc.executor.shutdown(wait=True)
        svc.helpers.close()
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert in_lane
    assert nice >= min(19, here + WORKER_NICENESS)

"""Many units on one Redis: model-pool routing, a unit killed mid-job, Redis killed and
restarted, a burst of jobs, cancels across units, dead letters, poison entries, result
expiry. A real redis-server on a free port; real service processes; no mocks."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import numpy as np
import pytest
import redis
from PIL import Image

from tests.images import astronaut, encode
from tests.jobs_harness import DETECT_APP, TARGET_APP, Unit, b64, start_units
from tests.redis_server import RedisServer

HAAR = "detect/haar/haarcascade_frontalface_default"
SHARED = "scripted/scripted/shared"
WORK = "/api/v1/work"


def centerface_label(unit: Unit) -> str:
    return next(lab for lab in unit.api.get("/info").json()["model_labels"] if lab.startswith("detect/centerface/"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture(scope="module")
def pair(server, tmp_path_factory):
    """Unit A has detect on Haar, unit B detect on CenterFace; both have the 'shared' model."""
    tmp = tmp_path_factory.mktemp("pair")
    queue = {"url": server.url, "prefix": "pair", "visibility_timeout_s": 300, "max_attempts": 3}
    a = Unit(tmp, "unit-a", {"detect": (DETECT_APP, {"backend": "haar", "warmup_runs": 1}),
                             "scripted": (TARGET_APP, {"model": "shared", "unit": "a", "batch": 2, "dry_run": True})},
             queue=queue, accept_models=["scripted/scripted/nobody"])
    b = Unit(tmp, "unit-b", {"detect": (DETECT_APP, {"backend": "centerface", "max_side": 320, "warmup_runs": 1}),
                             "scripted": (TARGET_APP, {"model": "shared", "unit": "b", "batch": 2, "dry_run": True})},
             queue=queue, accept_models=["scripted/scripted/nobody"])
    try:
        start_units(a, b)
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture
def rds(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def face() -> str:
    return b64(encode(np.asarray(Image.fromarray(astronaut()).resize((128, 128)))))


def test_every_job_runs_on_a_unit_that_has_its_model(pair):
    a, b = pair
    cf = centerface_label(b)
    assert set(a.api.get("/info").json()["known_models"]) >= {HAAR, cf, SHARED}
    img = face()
    haar_jobs = [b.submit("detect", "/api/v1/facedetect", model=HAAR, image=img)["id"] for _ in range(6)]
    cf_jobs = [a.submit("detect", "/api/v1/facedetect", model=cf, image=img)["id"] for _ in range(6)]
    for job_id in haar_jobs:
        done = a.wait(job_id)  # any unit answers for any job
        assert done["state"] == "succeeded" and done["node"] == "unit-a" and done["model"] == HAAR
        assert b.job(job_id) == done
    for job_id in cf_jobs:
        done = b.wait(job_id)
        assert done["state"] == "succeeded" and done["node"] == "unit-b" and done["model"] == cf
        assert done["result"]["faces"][0]["landmarks"]  # CenterFace gives landmarks; Haar never does
    r = a.api.post("/v1/jobs", json={"service": "detect", "route": "/api/v1/facedetect", "image": img})
    assert r.status_code == 422 and r.json()["error"]["code"] == "model_required"


def test_a_burst_of_200_jobs_all_succeed_and_the_lag_returns_to_zero(pair):
    a, b = pair
    cf = centerface_label(b)
    img = face()
    plans = [("scripted", WORK, {"model": SHARED, "body": {"tag": f"burst-{i}", "sleep_s": 0.01}}) if i % 2 else
             ("detect", "/api/v1/facedetect", {"model": HAAR if i % 4 else cf, "image": img}) for i in range(200)]

    def submit(i: int) -> str:
        service, route, fields = plans[i]
        return (a if i % 3 else b).submit(service, route, **fields)["id"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(submit, range(200)))
    assert len(set(ids)) == 200
    nodes = {}
    for job_id in ids:
        done = a.wait(job_id, timeout=120)
        assert done["state"] == "succeeded", done
        nodes.setdefault(done["model"], set()).add(done["node"])
    assert nodes == {SHARED: {"unit-a", "unit-b"}, HAAR: {"unit-a"}, cf: {"unit-b"}}  # the shared model scaled out
    for unit in (a, b):
        deadline = time.monotonic() + 15
        while True:
            streams = unit.stats()["jobs"]["streams"]
            if streams and all(s["lag"] == 0 and s["pending"] == 0 and s["in_progress"] == 0 for s in streams):
                break
            assert time.monotonic() < deadline, streams
            time.sleep(0.1)
    metrics = a.api.get("/metrics").text
    assert 'onecard_jobs_stream_lag{stream="pair:stream:scripted/scripted/shared"} 0.0' in metrics


def test_cancel_reaches_the_unit_running_the_job(pair):
    a, b = pair
    job = a.submit("scripted", WORK, model=SHARED, body={"tag": "cancel-me", "sleep_s": 120})
    running = a.wait(job["id"], ("running",))
    runner, other = (a, b) if running["node"] == "unit-a" else (b, a)
    deadline = time.monotonic() + 10
    while "cancel-me" not in runner.calls("scripted")["started"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = other.api.delete(f"/v1/jobs/{job['id']}")  # asked of the unit that does not run it
    assert r.status_code == 202 and r.json()["cancel_requested"]
    # the lease is renewed every 100 s here: only the pub/sub message can stop it this soon
    done = other.wait(job["id"], timeout=30)
    assert done["state"] == "cancelled"
    assert "cancel-me" in runner.calls("scripted")["disconnected"]


def test_a_job_for_a_model_no_unit_has_waits_and_can_be_cancelled(pair, rds):
    a, b = pair
    job = a.submit("scripted", WORK, model="scripted/scripted/nobody", body={"tag": "nobody"})
    assert b.job(job["id"])["state"] == "queued"
    stream = "pair:stream:scripted/scripted/nobody"
    assert rds.xinfo_groups(stream)[0]["lag"] == 1  # KEDA's lagCount sees it: a unit may be scaled up
    r = b.api.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert a.job(job["id"])["state"] == "cancelled"


def test_failing_jobs_are_retried_on_any_unit_then_dead_lettered(pair, rds):
    a, b = pair
    job = a.submit("scripted", WORK, model=SHARED, body={"tag": "always-500", "status": 500, "code": "kaput"})
    done = b.wait(job["id"])
    assert done["state"] == "failed" and done["attempts"] == 3 and done["error"]["code"] == "kaput"
    runs = a.calls("scripted")["started"].count("always-500") + b.calls("scripted")["started"].count("always-500")
    assert runs == 3
    dead = rds.xrange("pair:dead:" + SHARED)  # other tests' poison entries may be there too
    ours = [fields for _, fields in dead if fields.get(b"id", b"").decode() == job["id"]]
    assert len(ours) == 1 and json.loads(ours[0][b"error"])["code"] == "kaput"
    dead_counts = [s["dead_lettered"] for u in (a, b) for s in u.stats()["jobs"]["streams"] if s["model"] == SHARED]
    assert dead_counts == [len(dead), len(dead)]


def test_poison_entries_never_break_a_consumer(pair, rds):
    a, b = pair
    stream = "pair:stream:" + SHARED
    rds.xadd(stream, {"no-id": "x"})
    rds.xadd(stream, {"id": "../../etc/passwd"})
    rds.xadd(stream, {"id": "f" * 32})  # a job that does not exist
    bad_route, bad_body = "a" * 32, "b" * 32
    for n, (job_id, route, body) in enumerate(((bad_route, "/calls", b"{}"), (bad_body, WORK, b"\xff not json"))):
        entry = f"{int(time.time() * 1000) + 60_000}-{n}"  # named up front: the job is whole before it is seen
        rds.hset(f"pair:job:{job_id}", mapping={"id": job_id, "state": "queued", "service": "scripted", "route": route,
                                                 "model": SHARED, "attempts": 0, "created_at": time.time(),
                                                 "entry": entry})
        rds.set(f"pair:body:{job_id}", body)
        rds.xadd(stream, {"id": job_id}, id=entry)
    done = a.wait(bad_route)
    assert done["state"] == "failed" and done["error"]["code"] == "unknown_route"
    done = a.wait(bad_body)
    assert done["state"] == "failed" and done["error"]["code"] == "bad_json" and done["attempts"] == 1
    job = b.submit("scripted", WORK, model=SHARED, body={"tag": "after-poison"})
    assert a.wait(job["id"])["state"] == "succeeded"
    for unit in (a, b):
        assert unit.api.get("/healthz").status_code == 200
    deadline = time.monotonic() + 10
    while rds.xlen(stream):
        assert time.monotonic() < deadline, rds.xrange(stream)
        time.sleep(0.05)


def test_a_job_record_edited_by_hand_is_still_shown_and_its_result_refused_in_words(pair, rds):
    """Fields the store holds that no version of onecard writes (an operator's edit, another
    version's): every page that showed such a job was a 500."""
    a, _ = pair
    jobs = [a.submit("scripted", WORK, model=SHARED, body={"tag": f"edited-{n}"}) for n in range(3)]
    for job in jobs:
        assert a.wait(job["id"])["state"] == "succeeded"
    rds.hset(f"pair:job:{jobs[0]['id']}", mapping={"attempts": "1.0", "runs": "many", "result_headers": "[1]",
                                                    "progress": "NaN", "node": "n\u00e9"})
    rds.hset(f"pair:job:{jobs[1]['id']}", mapping={"state": "failed", "error": '["boom"]', "result_status": "x"})
    shown = a.api.get(f"/v1/jobs/{jobs[0]['id']}")
    assert shown.status_code == 200 and shown.json()["attempts"] == 0, shown.text
    assert a.api.get(f"/v1/jobs/{jobs[0]['id']}/result").status_code == 200
    failed = a.api.get(f"/v1/jobs/{jobs[1]['id']}/result")
    assert failed.status_code == 409 and failed.json()["error"]["code"] == "job_failed", failed.text
    rds.hset(f"pair:job:{jobs[2]['id']}", mapping={"node": b"n\xe9 no UTF-8", "result_status": "700",
                                                    "result_type": "image/png\r\nX-Injected: 1",
                                                    "result_headers": '{"x-seed": "\u0100"}'})
    third = a.api.get(f"/v1/jobs/{jobs[2]['id']}")
    assert third.status_code == 200 and third.json()["node"] == "n\ufffd no UTF-8", third.text
    result = a.api.get(f"/v1/jobs/{jobs[2]['id']}/result")
    assert result.status_code == 200 and "x-injected" not in result.headers and "x-seed" not in result.headers
    # control characters uvicorn refuses once the answer has started (it closed without a byte),
    # and a status that carries no body (its body would be read as the next answer)
    rds.hset(f"pair:job:{jobs[0]['id']}", mapping={"result_type": "image/png\x0b", "result_status": "204",
                                                    "result_headers": '{"x-seed": "1\\u00002"}'})
    result = a.api.get(f"/v1/jobs/{jobs[0]['id']}/result")
    assert result.status_code == 200 and result.headers["content-type"] == "application/octet-stream", result
    assert "x-seed" not in result.headers and len(result.content) == int(result.headers["content-length"]) > 0
    listed = a.api.get("/v1/jobs", params={"model": SHARED, "limit": 50})
    assert listed.status_code == 200, listed.text


def test_a_listing_index_edited_by_hand_still_pages_through_every_job(pair, rds):
    """Index entries no version of onecard writes: an infinite or huge score was a 500 or a
    next_cursor the API refused (hiding every job after it), a member that is no job id the
    same; a dead-lettered record without its id field made redrive by model a 500."""
    a, _ = pair
    model = "scripted/scripted/edited"
    ids = [f"{n:032x}" for n in range(1, 13)]
    for n, job_id in enumerate(ids):
        rds.hset(f"pair:job:{job_id}", mapping={"state": "succeeded", "model": model, "service": "scripted"})
        rds.zadd(f"pair:idx:succeeded:{model}", {job_id: 1_700_000_000_000_000 + n})
    rds.zadd(f"pair:idx:succeeded:{model}", {ids[4]: float("inf"), ids[5]: float("inf"), ids[9]: 1e300,
                                              "not-a-job": 5, b"\xff": 6})
    rds.hset("pair:job:not-a-job", mapping={"state": "succeeded", "model": model})
    for limit in (5, 1):  # one a page: every entry ends one, with more after it
        got, cursor = [], None
        for _ in range(20):
            page = a.api.get("/v1/jobs", params={"model": model, "limit": limit, "state": "succeeded",
                                                **({"cursor": cursor} if cursor else {})})
            assert page.status_code == 200, page.text
            got += [job["id"] for job in page.json()["jobs"]]
            if (cursor := page.json()["next_cursor"]) is None:
                break
        assert sorted(got) == ids, (limit, got)
    dead = "e" * 32
    rds.hset(f"pair:job:{dead}", mapping={"state": "failed", "dead": "1", "model": model})  # no id field, no body
    rds.zadd(f"pair:idx:dead:{model}", {dead: 1_700_000_000_000_000})
    redriven = a.api.post("/v1/jobs/redrive", json={"model": model})
    assert redriven.status_code == 200, redriven.text
    assert redriven.json()["skipped"] == [{"id": dead, "reason": "no_body"}], redriven.text
    listed = a.api.get("/v1/jobs", params={"model": model, "state": "dead"})
    assert [job["id"] for job in listed.json()["jobs"]] == [dead], listed.text
    assert a.api.get("/v1/jobs", params={"model": model, "limit": "0" * 4300 + "3"}).status_code == 200


def test_results_expire_after_their_ttl(server, rds, tmp_path):
    u = Unit(tmp_path, "ttl", {"scripted": (TARGET_APP, {"model": "m1"})},
             queue={"url": server.url, "prefix": "ttl", "results_ttl_s": 1.0})
    try:
        start_units(u)
        job = u.submit("scripted", WORK, body={"tag": "ttl"})
        assert u.wait(job["id"])["state"] == "succeeded"
        assert rds.exists(f"ttl:result:{job['id']}") and not rds.exists(f"ttl:body:{job['id']}")
        assert 0 < rds.pttl(f"ttl:job:{job['id']}") <= 1000
        deadline = time.monotonic() + 10
        while u.api.get(f"/v1/jobs/{job['id']}").status_code == 200:
            assert time.monotonic() < deadline, "never expired"
            time.sleep(0.1)
        assert u.api.get(f"/v1/jobs/{job['id']}/result").status_code == 404
        assert not rds.exists(f"ttl:job:{job['id']}", f"ttl:result:{job['id']}")
    finally:
        u.stop()


def test_sigkill_a_unit_mid_job_and_the_job_completes_on_the_other_with_one_result(server, rds, tmp_path):
    queue = {"url": server.url, "prefix": "kill", "visibility_timeout_s": 1.0, "max_attempts": 3}
    units = [Unit(tmp_path, f"unit-{n}", {"scripted": (TARGET_APP, {"model": "m1", "unit": n, "dry_run": True})},
                  queue=queue)
             for n in ("x", "y")]
    try:
        start_units(*units)
        job = units[0].submit("scripted", WORK, body={"tag": "survivor", "sleep_s": 2})
        running = units[0].wait(job["id"], ("running",))
        victim = next(u for u in units if u.node == running["node"])
        other = next(u for u in units if u is not victim)
        deadline = time.monotonic() + 10
        while "survivor" not in victim.calls("scripted")["started"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        victim.kill()
        done = other.wait(job["id"], timeout=60)
        # two runs, one attempt: losing a unit is charged only to a job that ran alone after a crash
        assert done["state"] == "succeeded" and done["node"] == other.node and done["runs"] == 2
        assert done["attempts"] == 1 and done["last_error"] is None
        assert done["result"]["unit"] == other.node[-1]
        assert other.calls("scripted")["finished"] == ["survivor"]
        stream = "kill:stream:scripted/scripted/m1"
        assert rds.xlen(stream) == 0 and rds.xpending(stream, "onecard")["pending"] == 0
        assert other.stats()["jobs"]["counts"].get("duplicate", 0) == 0
        raw = other.api.get(f"/v1/jobs/{job['id']}/result")
        assert raw.status_code == 200 and raw.json()["unit"] == other.node[-1]
    finally:
        for u in units:
            u.stop()


def test_redis_killed_and_restarted_mid_run_loses_no_accepted_job(tmp_path):
    with RedisServer(tmp_path, aof=True) as srv:
        u = Unit(tmp_path, "restart", {"scripted": (TARGET_APP, {"model": "m1", "batch": 3, "dry_run": True})},
                 queue={"url": srv.url, "prefix": "rs", "visibility_timeout_s": 2.0})
        try:
            start_units(u)

            def submit(i: int) -> str:
                """A client that retries with its Idempotency-Key until the job is accepted."""
                deadline = time.monotonic() + 60
                while True:
                    try:
                        r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK,
                                                         "body": {"tag": f"r{i}", "sleep_s": 0.3}},
                                       headers={"Idempotency-Key": f"job-{i}"})
                        if r.status_code == 202:
                            return r.json()["id"]
                        assert r.status_code == 503, r.text
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "never accepted"
                    time.sleep(0.1)

            ids = [submit(i) for i in range(20)]
            deadline = time.monotonic() + 30
            while sum(u.job(j)["state"] == "succeeded" for j in ids) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert any(u.job(j)["state"] != "succeeded" for j in ids), "all done before the crash"
            srv.kill()
            time.sleep(0.5)
            r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {}})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable"
            srv.start()
            ids += [submit(i) for i in range(20, 40)]
            assert len(set(ids)) == 40
            for job_id in ids:
                assert u.wait(job_id, timeout=60)["state"] == "succeeded"
            started = u.calls("scripted")["started"]
            assert {f"r{i}" for i in range(40)} <= set(started)
            # Redis came back with its data (AOF): no loss is reported
            assert 'onecard_jobs_queue_events_total{event="data_lost"} 0.0' in u.api.get("/metrics").text
        finally:
            u.stop()


def test_long_poll_on_one_unit_wakes_when_another_finishes_the_job(pair):
    a, b = pair
    job = a.submit("detect", "/api/v1/facedetect", model=centerface_label(b), image=face())
    r = a.api.get(f"/v1/jobs/{job['id']}", params={"wait": 30}, timeout=8)  # run by b, awaited on a
    assert r.json()["state"] == "succeeded" and r.json()["node"] == "unit-b"


def test_sigterm_drains_a_unit_it_takes_nothing_new_and_hands_back_what_it_cannot_finish(server, tmp_path):
    queue = {"url": server.url, "prefix": "drain", "visibility_timeout_s": 30}
    target = {"scripted": (TARGET_APP, {"model": "m1", "unit": "x", "dry_run": True})}
    x = Unit(tmp_path, "unit-x", target, target_settings={"scripted": {"max_in_flight": 1}}, queue=queue, drain_s=1.0)
    y = Unit(tmp_path, "unit-y", {"scripted": (TARGET_APP, {"model": "m1", "unit": "y", "dry_run": True})},
             queue=queue)
    try:
        start_units(x)
        long = x.submit("scripted", WORK, body={"tag": "long", "sleep_s": 4})
        x.wait(long["id"], ("running",))
        nxt = x.submit("scripted", WORK, body={"tag": "next"})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            poll = pool.submit(lambda: x.api.get(f"/v1/jobs/{nxt['id']}", params={"wait": 10}, timeout=20))
            time.sleep(0.3)  # the long poll is open
            x.jobs.proc.send_signal(signal.SIGTERM)
            assert poll.result(timeout=5).json()["state"] == "queued"  # woken by the drain, not held 10 s
        # uvicorn re-raises the SIGTERM it captured once its graceful shutdown is over
        assert x.jobs.proc.wait(timeout=20) in (0, -signal.SIGTERM)
        rds = redis.Redis.from_url(server.url)
        try:
            state = {k.decode(): v.decode() for k, v in rds.hgetall(f"drain:job:{long['id']}").items()}
            assert state["state"] == "queued" and state["attempts"] == "0"  # handed back, not a failed attempt
            assert rds.hget(f"drain:job:{nxt['id']}", "state") == b"queued"
        finally:
            rds.close()
        calls = x.calls("scripted")
        assert "next" not in calls["started"] and "long" in calls["disconnected"]
        start_units(y)
        for job in (long, nxt):
            done = y.wait(job["id"])
            assert done["state"] == "succeeded" and done["node"] == "unit-y" and done["attempts"] == 1
    finally:
        x.stop()
        y.stop()

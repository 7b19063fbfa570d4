"""What queue users expect of the jobs API, on a real unit (embedded and on Redis): a
bounded, paginated listing by model and state; priority levels (FIFO within a level);
retries after a backoff; the dead-letter redrive through the API and `onecard jobs redrive`;
submits admitted against a memory bound before their bodies are read."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.harness import ROOT
from tests.jobs_harness import TARGET_APP, Unit, error_of, start_units
from tests.redis_server import RedisServer

WORK = "/api/v1/work"
MODEL = "scripted/scripted/m1"


def journal(path) -> list[tuple[str, str]]:
    try:
        return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module", params=["embedded", "redis"])
def unit(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"api-{request.param}")
    srv = RedisServer(tmp).start() if request.param == "redis" else None
    log = tmp / "journal"
    queue = {"max_attempts": 1, "retry_backoff_s": 0.5, "retry_backoff_max_s": 0.5, **({"url": srv.url} if srv else {})}
    target = {"model": "m1", "dry_run": True, "journal": str(log), "max_body_bytes": 4 * 2**20}
    u = Unit(tmp, f"api-{request.param}", {"scripted": (TARGET_APP, target)},
             target_settings={"scripted": {"max_in_flight": 1}}, queue=queue, max_list_limit=5)
    u.log = log
    try:
        start_units(u)
        yield u
    finally:
        u.stop()
        if srv is not None:
            srv.stop()


def listing(u: Unit, state: str, **params) -> dict:
    r = u.api.get("/v1/jobs", params={"model": MODEL, "state": state, **params})
    assert r.status_code == 200, r.text
    return r.json()


def test_higher_priority_jobs_run_first_and_each_level_in_order(unit):
    blocker = unit.submit("scripted", WORK, body={"tag": "blocker", "sleep_s": 1.0})["id"]
    unit.wait(blocker, ("running",))
    plan = [("low", "p-l1"), ("normal", "p-n1"), ("high", "p-h1"), ("normal", "p-n2"), ("high", "p-h2")]
    ids = [unit.submit("scripted", WORK, body={"tag": tag}, priority=level)["id"] for level, tag in plan]
    queued = listing(unit, "queued")["jobs"]
    assert [j["id"] for j in queued] == ids and [j["priority"] for j in queued] == [p for p, _ in plan]
    for job_id in ids:
        assert unit.wait(job_id)["state"] == "succeeded"
    starts = [t for e, t in journal(unit.log) if e == "started" and t.startswith("p-")]
    assert starts == ["p-h1", "p-h2", "p-n1", "p-n2", "p-l1"]
    r = unit.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "priority": "urgent"})
    assert r.status_code == 422 and "priority" in r.json()["error"]["message"]


def test_the_listing_is_paginated_and_bounded(unit):
    ids = [unit.submit("scripted", WORK, body={"tag": f"list-{i}"})["id"] for i in range(7)]
    for job_id in ids:
        assert unit.wait(job_id)["state"] == "succeeded"
    seen, cursor = [], None
    while True:
        page = listing(unit, "succeeded", limit=3, **({"cursor": cursor} if cursor else {}))
        assert len(page["jobs"]) <= 3 and page["model"] == MODEL and page["state"] == "succeeded"
        assert all(j["state"] == "succeeded" and "result" not in j for j in page["jobs"])
        seen += [j["id"] for j in page["jobs"]]
        if not (cursor := page["next_cursor"]):
            break
    assert seen[-7:] == ids  # oldest first, the jobs of earlier tests before them
    assert len(listing(unit, "succeeded")["jobs"]) == 5  # the default page is capped by max_list_limit
    assert len(listing(unit, "succeeded", limit="0" * 20 + "3")["jobs"]) == 3  # leading zeros are no digits too many
    for params, fragment in (({"model": MODEL, "state": "succeeded", "limit": 6}, "limit"),
                             ({"model": MODEL, "state": "succeeded", "limit": 0}, "limit"),
                             ({"model": MODEL, "state": "succeeded", "limit": "\u0663"}, "limit"),
                             ({"model": MODEL, "state": "succeeded", "limit": "9" * 4301}, "limit"),
                             ({"model": MODEL, "state": "finished"}, "state"), ({"state": "queued"}, "model"),
                             ({"model": MODEL, "cursor": "9:"}, "cursor"),
                             ({"model": "x y", "state": "queued"}, "model"),
                             ({"model": MODEL, "state": "queued", "cursor": "zz"}, "cursor"),
                             ({"model": MODEL, "state": "queued", "cursor": "12"}, "cursor")):
        r = unit.api.get("/v1/jobs", params=params)
        assert r.status_code == 422 and fragment in r.json()["error"]["message"], (params, r.text)
    assert listing(unit, "running", model="other/x/y")["jobs"] == []
    # without a state: every state in turn, paged the same way
    everything, cursor = [], None
    while True:
        r = unit.api.get("/v1/jobs", params={"model": MODEL, "limit": 4, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200 and len(r.json()["jobs"]) <= 4, r.text
        everything += [j["id"] for j in r.json()["jobs"]]
        if not (cursor := r.json()["next_cursor"]):
            break
    assert everything[-len(seen):] == seen and len(set(everything)) == len(everything)


def test_the_embedded_store_fits_the_memory_the_supervisor_planned(tmp_path):
    """A jobs service with 1 GiB of planned memory keeps at most 60 % of it, less its submits'
    room, in queued bodies and results (not 1 GiB of each): what /info says its queue holds."""
    u = Unit(tmp_path, "budget", {"scripted": (TARGET_APP, {"model": "m1"})})
    u.jobs.env["ONECARD_MEMORY_BUDGET_BYTES"] = str(2**30)
    try:
        start_units(u)
        queue = u.api.get("/info").json()["queue"]
        assert queue["mode"] == "embedded"
        assert queue["max_queued_bytes"] + queue["max_results_bytes"] <= 0.6 * 2**30 - 256 * 2**20, queue
    finally:
        u.stop()


def test_a_failed_attempt_is_retried_after_its_backoff(tmp_path):
    log = tmp_path / "journal"
    u = Unit(tmp_path, "backoff", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "journal": str(log)})},
             queue={"max_attempts": 3, "retry_backoff_s": 1.0, "retry_jitter": 0})
    try:
        start_units(u)
        job_id = u.submit("scripted", WORK, body={"tag": "flaky", "status": 500, "code": "oops", "times": 1})["id"]
        deadline = time.monotonic() + 10
        while (waiting := u.job(job_id))["attempts"] != 1:  # the failed attempt, waiting for its retry
            assert time.monotonic() < deadline, waiting
            time.sleep(0.02)
        assert waiting["state"] == "queued" and waiting["last_error"]["code"] == "oops"
        failed_at, retry_at = waiting["started_at"], waiting["retry_at"]
        assert retry_at is not None and retry_at >= failed_at + 0.9  # one backoff step (1 s, no jitter)
        done = u.wait(job_id)
        assert done["state"] == "succeeded" and done["attempts"] == 2 and done["started_at"] >= retry_at
    finally:
        u.stop()


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", "jobs", "redrive", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_dead_lettered_jobs_are_redriven_by_id_and_by_model(unit):
    dead = [unit.submit("scripted", WORK, body={"tag": f"dead-{i}", "status": 500, "times": 1})["id"] for i in range(3)]
    for job_id in dead:
        done = unit.wait(job_id)
        assert done["state"] == "failed" and done["dead_lettered"], done
    assert [j["id"] for j in listing(unit, "dead")["jobs"]][-3:] == dead
    r = unit.api.post(f"/v1/jobs/{dead[0]}/redrive")
    assert r.status_code == 200 and r.json()["state"] == "queued" and r.json()["attempts"] == 0, r.text
    done = unit.wait(dead[0])
    assert done["state"] == "succeeded" and not done["dead_lettered"] and done["runs"] == 2
    assert unit.api.post(f"/v1/jobs/{dead[0]}/redrive").json()["error"]["code"] == "job_not_dead_lettered"
    assert unit.api.post(f"/v1/jobs/{'0' * 32}/redrive").status_code == 404
    assert unit.api.post("/v1/jobs/nope/redrive").status_code == 404
    out = cli("--model", MODEL, "--url", unit.jobs.url)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert set(dead[1:]) <= set(answer["redriven"]) and answer["queue_full"] is False
    for job_id in dead[1:]:
        assert unit.wait(job_id)["state"] == "succeeded"
    out = cli("--id", dead[1], "--url", unit.jobs.url)
    assert out.returncode == 1 and "job_not_dead_lettered" in out.stderr
    r = unit.api.post("/v1/jobs/redrive", json={"model": MODEL, "limit": 0})
    assert r.status_code == 422
    assert cli("--id", dead[1], "--url", "http://127.0.0.1:1").returncode == 2  # nothing listens there
    assert cli("--url", unit.jobs.url).returncode == 2  # neither --id nor --model


def test_submits_are_admitted_against_a_memory_bound_before_their_bodies_are_read(tmp_path):
    u = Unit(tmp_path, "admit", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True,
                                                             "max_body_bytes": 4 * 2**20})},
             submit_memory_bytes=4 * 2**20, max_body_bytes=2 * 2**20, body_timeout_s=60, submit_wait_s=1)
    held = None
    try:
        start_units(u)
        held = socket.create_connection(("127.0.0.1", u.jobs.port), timeout=10)
        held.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2000000\r\n\r\n" + b'{"service": "scripted", ')
        stop_trickle = threading.Event()

        def trickle() -> None:  # its body keeps arriving (slowly): it keeps its share
            while not stop_trickle.wait(0.2):
                held.sendall(b" ")
        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", u.jobs.port), timeout=10) as s:
            s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 2000000\r\n\r\n{")  # its body begun: it waits its turn for the rest
            reply = b""
            while chunk := s.recv(65536):  # the answer closes the connection: its body was never read
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "busy" and "submit_memory_bytes" in body["error"]["message"]
        submits = u.api.get("/stats").json()["jobs"]["submits"]
        assert submits["waited"] == 1 and submits["refused"] == 1  # it waited submit_wait_s for room, in vain
        assert u.api.get("/healthz").status_code == 200
        stop_trickle.set()
        trickler.join()
        held.close()
        held = None
        deadline = time.monotonic() + 10
        while (r := u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK,
                                                  "body": {"tag": "after"}})).status_code == 503:
            assert time.monotonic() < deadline, r.text  # the held one's share comes back once it is gone
            time.sleep(0.1)
        assert r.status_code == 202, r.text
    finally:
        if held is not None:
            held.close()
        u.stop()


def test_submits_that_ask_for_100_continue_and_send_nothing_take_no_share_of_the_bound(tmp_path):
    """Eight clients announce 2 MB submits, ask for 100 Continue and send nothing (each would
    take the whole bound): they get their 100 and hold a connection, not the bound, and a
    legitimate submit is answered at once; sent, their bodies are read as any other."""
    u = Unit(tmp_path, "expect", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True,
                                                              "max_body_bytes": 4 * 2**20})},
             submit_memory_bytes=4 * 2**20, max_body_bytes=2 * 2**20, body_timeout_s=60, submit_wait_s=3)
    stalled: list[socket.socket] = []
    try:
        start_units(u)
        doc = {"service": "scripted", "route": WORK, "body": {"tag": "late", "pad": ""}}
        doc["body"]["pad"] = "x" * (2_000_000 - len(json.dumps(doc)))
        body = json.dumps(doc).encode()
        assert len(body) == 2_000_000
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", u.jobs.port), timeout=10)
            stalled.append(s)
            s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Expect: 100-continue\r\nContent-Length: 2000000\r\n\r\n")
        time.sleep(0.3)
        t0 = time.monotonic()
        r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {"tag": "legit"}})
        assert r.status_code == 202, r.text  # (behind the first of them it waited submit_wait_s: 503 busy)
        assert time.monotonic() - t0 < 2.0
        assert u.api.get("/stats").json()["jobs"]["submits"]["waited"] == 0
        for s in stalled:
            assert s.recv(100).startswith(b"HTTP/1.1 100"), "no 100 Continue"
        stalled[0].sendall(body)  # a late body is read as any other
        assert stalled[0].recv(4096).startswith(b"HTTP/1.1 202")
    finally:
        for s in stalled:
            s.close()
        u.stop()


def test_a_submit_whose_body_stops_gives_its_share_back_when_others_wait(tmp_path):
    """A submit that took the whole bound and sent one byte of its 2 MB body, then nothing for
    2 s, keeps its share while nobody waits, and gets 408 body_stalled as soon as another
    submit waits for room (the body rate's 5 s grace kept it there past the other's
    submit_wait_s: 503 busy); the other is read and queued."""
    u = Unit(tmp_path, "stall", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True,
                                                             "max_body_bytes": 4 * 2**20})},
             submit_memory_bytes=4 * 2**20, max_body_bytes=2 * 2**20, body_timeout_s=60, submit_wait_s=2)
    try:
        start_units(u)
        with socket.create_connection(("127.0.0.1", u.jobs.port), timeout=10) as stalled:
            stalled.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 2000000\r\n\r\n{")
            time.sleep(2.0)  # alone, it keeps its share: nobody waits for it
            t0 = time.monotonic()
            r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {"tag": "behind"}})
            waited = time.monotonic() - t0
            reply = b""
            while chunk := stalled.recv(65536):
                reply += chunk
            assert r.status_code == 202, r.text
            assert waited < 1.5, (waited, reply)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_stalled"
        submits = u.api.get("/stats").json()["jobs"]["submits"]
        assert submits["waited"] == 1 and submits["refused"] == 0 and submits["held_bytes"] == 0, submits
    finally:
        u.stop()


def test_a_small_submit_whose_client_left_while_it_waited_in_line_makes_no_job(tmp_path):
    """Its whole body came with its head, before it waited for room behind a submit that held
    the bound; its client left meanwhile: given room, it makes no job (a retry with the same
    Idempotency-Key makes the job, not a replay of one made for nobody)."""
    u = Unit(tmp_path, "left", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True,
                                                            "max_body_bytes": 4 * 2**20})},
             submit_memory_bytes=4 * 2**20, max_body_bytes=2 * 2**20, body_timeout_s=60, submit_wait_s=5)
    try:
        start_units(u)
        body = json.dumps({"service": "scripted", "route": WORK, "body": {"tag": "left"}}).encode()
        with socket.create_connection(("127.0.0.1", u.jobs.port), timeout=10) as held:
            held.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2000000\r\n\r\n{")
            time.sleep(0.3)  # it holds the whole bound, alone (nothing waits: it keeps it)
            with socket.create_connection(("127.0.0.1", u.jobs.port), timeout=10) as left:
                left.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Idempotency-Key: left-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(0.1)
            # the holder's body has brought nothing for over 1 s once the other waits: it is cut
            # and the one that left is given room
            reply = b""
            while chunk := held.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        time.sleep(0.5)
        r = u.api.post("/v1/jobs", content=body, headers={"Content-Type": "application/json",
                                                           "Idempotency-Key": "left-1"})
        assert r.status_code == 202 and "idempotent-replayed" not in r.headers, (r.text, dict(r.headers))
        assert u.api.get("/stats").json()["jobs"]["submits"]["held_bytes"] == 0
    finally:
        u.stop()


def test_a_burst_of_big_submits_waits_its_turn_and_each_gets_its_own_answer(tmp_path):
    """Six 1.5 MB submits at once where the bound holds one: none is refused for the others;
    they are read one after another, first come first served, and every one is a job."""
    u = Unit(tmp_path, "burst", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True,
                                                             "max_body_bytes": 4 * 2**20})},
             submit_memory_bytes=5 * 2**20, max_body_bytes=2 * 2**20)
    try:
        start_units(u)
        pad = "x" * (1500 * 1024)

        def submit(i: int) -> httpx.Response:
            return httpx.post(u.jobs.url + "/v1/jobs", timeout=60,
                              json={"service": "scripted", "route": WORK, "body": {"tag": f"burst-{i}", "pad": pad}})

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(submit, range(6)))
        assert [r.status_code for r in answers] == [202] * 6, [r.text[:200] for r in answers]
        submits = u.api.get("/stats").json()["jobs"]["submits"]
        assert submits["waited"] >= 1 and submits["refused"] == 0 and submits["held_bytes"] == 0, submits
    finally:
        u.stop()


def test_a_big_submit_is_checked_in_a_helper_process_with_the_same_answers(unit):
    """Over 1 MiB, the parse and the checks run in a helper process (they would hold the GIL
    here for tens of milliseconds): the answers are those of a small submit."""
    pad = "x" * (2 * 2**20)
    for fields, status, code in (
            ({"service": "nope", "route": WORK, "image": "!!", "params": {"p": pad}}, 422, "unknown_service"),
            ({"service": "scripted", "route": WORK, "image": "AAAA#", "params": {"p": pad}}, 400, "bad_base64"),
            ({"service": "scripted", "route": WORK, "params": {"p": pad, "x": float("nan")}}, 422, "invalid_parameter"),
            ({"service": "scripted", "route": WORK, "model": "scripted/scripted/other", "params": {"p": pad}}, 422,
             "unknown_model")):
        r = unit.api.post("/v1/jobs", content=json.dumps(fields), headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    job = unit.submit("scripted", WORK, body={"tag": "big-submit", "p": pad, "pad": 3 * 2**20})
    done = unit.wait(job["id"])  # its 3 MB JSON answer was checked in the helper process too: inline as JSON
    assert done["state"] == "succeeded" and done["result"]["tag"] == "big-submit"
    assert len(done["result"]["pad"]) == 3 * 2**20
    assert psutil.Process(unit.jobs.proc.pid).children(), "no helper process"


def test_the_jobs_api_takes_http_basic_and_slows_down_guessing(tmp_path):
    """The jobs service stands on the same shell: HTTP Basic besides the key, and the failure
    limiter in front of both."""
    pairs = tmp_path / "pairs"
    pairs.write_text("ops:pa55word\n")
    unit = Unit(tmp_path, "auth", targets={}, basic_auth_file=str(pairs), auth_max_failures=2)
    unit.start()
    try:
        unit.jobs.wait_ready()
        job = "/v1/jobs/" + "0" * 32  # no such job: a 404 once the credentials pass
        assert unit.api.get(job).status_code == 401
        r = unit.api.get(job, auth=("ops", "pa55word"))
        assert r.status_code == 404 and error_of(r)["code"] == "job_not_found"
        assert [unit.api.get(job, auth=("ops", "nope")).status_code for _ in range(2)] == [401, 401]
        locked = unit.api.get(job, auth=("ops", "pa55word"))
        assert locked.status_code == 429 and locked.json()["error"]["code"] == "too_many_auth_failures"
        assert unit.api.get("/healthz").status_code == 200
    finally:
        unit.kill()

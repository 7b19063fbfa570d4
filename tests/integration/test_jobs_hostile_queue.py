"""The jobs service in a hostile environment: an embedded queue full of finished jobs, a
Redis that stops answering (503 quickly, a bounded pool), a Redis at its maxmemory, a queue
URL variable that is missing (the service, and the unit, stop with 78). A real
redis-server; every process is stopped by the test that started it."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time

import httpx
import psutil
import pytest

from tests.harness import ROOT, SupervisorRun, fake_service, free_port
from tests.jobs_harness import JOBS_APP, TARGET_APP, Proc, Unit, error_of, idempotency_rules, start_units
from tests.redis_server import RedisServer

WORK = "/api/v1/work"


SCRIPTED = "scripted/scripted/m1"


MAX_RESULT = 200_000


# ---- the embedded queue's bounds ---------------------------------------------------------
def test_the_embedded_queue_evicts_its_oldest_finished_jobs(tmp_path):
    u = Unit(tmp_path, "small", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             target_settings={"scripted": {"max_in_flight": 1}},
             queue={"max_finished_jobs": 3, "max_results_bytes": 110_000, "max_queued_bytes": 100_000},
             max_result_bytes=50_000, queue_wait_s=1)
    try:
        start_units(u)
        ids = []
        for i in range(5):  # one after the other: each is read before a later one can evict it
            ids.append(u.submit("scripted", WORK, params={"tag": f"j{i}"})["id"])
            assert u.wait(ids[-1])["state"] == "succeeded"
        seen = [u.api.get(f"/v1/jobs/{i}").status_code for i in ids]
        assert seen == [404, 404, 200, 200, 200], seen
        # by bytes: three results of 40 kB, each with its 12 KiB record, do not fit in 110 kB (two do);
        # the oldest goes
        big = []
        for i in range(3):
            big.append(u.submit("scripted", WORK, params={"tag": f"b{i}", "pad": 40_000})["id"])
            assert u.wait(big[-1])["state"] == "succeeded"
        seen = [u.api.get(f"/v1/jobs/{i}", params={"result": "false"}).status_code for i in big]
        assert seen == [404, 200, 200], seen
        assert u.api.get(f"/v1/jobs/{big[2]}/result").status_code == 200
        # the bodies of waiting jobs: one runs for a while, three of 30 kB wait, a fourth does not
        # fit: it waits queue_wait_s for room, then 503
        held = [u.submit("scripted", WORK, params={"tag": "hold", "sleep_s": 4})["id"]]
        held += [u.submit("scripted", WORK, params={"tag": f"q{i}", "p": "x" * 30_000})["id"] for i in range(3)]
        sent = time.monotonic()
        r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "params": {"p": "x" * 30_000}})
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert error_of(r)["code"] == "queue_full" and "max_queued_bytes" in error_of(r)["message"]
        assert "queue_wait_s" in error_of(r)["message"] and time.monotonic() - sent >= 0.9
        assert u.wait(held[-1])["state"] == "succeeded"  # the last to run (the first are evicted by now)
        room = u.submit("scripted", WORK, params={"tag": "room", "p": "x" * 30_000})
        assert u.wait(room["id"])["state"] == "succeeded"
    finally:
        u.stop()


def test_a_submit_that_finds_the_queue_full_waits_its_turn_for_room(tmp_path):
    """helper-49: 12 sessions sending 12-16 MB jobs one after the other got 16 503s in 20 s from
    a queue that frees room as jobs run. A submit with no room waits in line (queue_wait_s) and
    is accepted once there is; a newcomer that would fit goes behind it, not ahead."""
    u = Unit(tmp_path, "wait", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             target_settings={"scripted": {"max_in_flight": 1}},
             queue={"max_queued_bytes": 100_000}, queue_wait_s=20)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        start_units(u)
        hold = u.submit("scripted", WORK, params={"tag": "hold", "sleep_s": 2.5})["id"]
        u.wait(hold, states={"running"})
        queued = [u.submit("scripted", WORK, params={"tag": f"q{i}", "p": "x" * 30_000})["id"] for i in range(3)]

        def post(params: dict) -> tuple[httpx.Response, float]:
            with httpx.Client(base_url=u.jobs.url, timeout=60, trust_env=False) as c:
                sent = time.monotonic()
                r = c.post("/v1/jobs", json={"service": "scripted", "route": WORK, "params": params})
                return r, time.monotonic() - sent

        big = pool.submit(post, {"tag": "big", "p": "x" * 30_000})  # no room until a job ends
        deadline = time.monotonic() + 10
        while u.api.get("/stats").json()["jobs"]["queue_room"]["waiting"] < 1:
            assert time.monotonic() < deadline and not big.done(), big.result()[0].text if big.done() else ""
            time.sleep(0.05)
        # a client that sends its submit and goes away while it waits: no job is made for it
        doc = json.dumps({"service": "scripted", "route": WORK, "params": {"tag": "gone"}}).encode()
        with socket.create_connection(("127.0.0.1", u.jobs.port)) as gone:
            gone.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Idempotency-Key: gone-1\r\nContent-Length: " + str(len(doc)).encode() + b"\r\n\r\n" + doc)
            while u.api.get("/stats").json()["jobs"]["queue_room"]["waiting"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        small = pool.submit(post, {"tag": "small"})  # would fit now: it must not overtake
        (r_big, t_big), (r_small, t_small) = big.result(), small.result()
        assert r_big.status_code == 202 and r_small.status_code == 202, (r_big.text, r_small.text)
        assert t_big >= 1.5, t_big  # it waited for the first job to end
        assert t_small >= 1.0, t_small  # it waited behind the big one, though it fitted
        assert u.api.get(f"/v1/jobs/{hold}").json()["state"] == "succeeded"
        for job_id in (*queued, r_big.json()["id"], r_small.json()["id"]):
            assert u.wait(job_id)["state"] == "succeeded"
        room = u.api.get("/stats").json()["jobs"]["queue_room"]
        assert room == {"waiting": 0, "waited": 3, "refused": 0, "client_gone": 1}, room
        again = u.api.post("/v1/jobs", json=json.loads(doc), headers={"Idempotency-Key": "gone-1"})
        assert again.status_code == 202 and "idempotent-replayed" not in again.headers, again.headers
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        u.stop()


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_finished_results_are_files_not_the_services_memory(tmp_path):
    """helper-50: 90 stored img2img results kept the jobs service 376 MiB above its start
    long after their clients had gone. Results are files in a private directory under
    results_dir: 24 results of 3 MB leave the service's memory near where it was, read back
    whole; a graceful stop removes the directory."""
    spool_parent = tmp_path / "results"
    spool_parent.mkdir()
    u = Unit(tmp_path, "spool", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             queue={"results_dir": str(spool_parent)}, max_result_bytes=4 * 2**20)
    try:
        start_units(u)
        warm = u.submit("scripted", WORK, params={"tag": "warm", "binary": 3 * 2**20})["id"]
        assert u.wait(warm)["state"] == "succeeded"
        before = _rss(u.jobs.proc.pid)
        ids = [u.submit("scripted", WORK, params={"tag": f"r{i}", "binary": 3 * 2**20})["id"] for i in range(24)]
        for job_id in ids:
            assert u.wait(job_id)["state"] == "succeeded"
        time.sleep(1)
        grown = _rss(u.jobs.proc.pid) - before
        assert grown < 24 * 2**20, f"{grown / 2**20:.0f} MiB for 72 MiB of results"  # in memory: 72 MiB and more
        (spool,) = list(spool_parent.iterdir())
        sizes = sorted(p.stat().st_size for p in spool.iterdir() if p.name != ".owner")
        assert sizes == [3 * 2**20] * 25, sizes
        r = u.api.get(f"/v1/jobs/{ids[5]}/result")
        assert r.status_code == 200 and len(r.content) == 3 * 2**20
        assert r.content == __import__("random").Random("r5").randbytes(3 * 2**20)
        u.jobs.proc.send_signal(signal.SIGTERM)
        u.jobs.proc.wait(30)
        assert list(spool_parent.iterdir()) == [], list(spool_parent.iterdir())
    finally:
        u.stop()


def test_readers_that_never_read_do_not_lock_the_others_out_of_results(tmp_path):
    """helper-52, helper-53: clients asking for a big result and never reading held every
    result slot until the send deadline cut them; 250 of them, reconnecting, kept every other
    reader (polls of any finished job too) at 503 busy. A slot is held only while a piece is
    read, never while the client is waited for: other readers are served at once."""
    u = Unit(tmp_path, "slots", targets={"scripted": (TARGET_APP, {"model": "m1"})}, max_result_bytes=4 * 2**20,
             max_result_streams=2, result_send_timeout_s=8, result_stream_wait_s=20)
    stalled = []
    try:
        start_units(u)
        job = u.submit("scripted", WORK, params={"tag": "big", "binary": 3 * 2**20})["id"]
        assert u.wait(job)["state"] == "succeeded"
        for path in [f"/v1/jobs/{job}/result", f"/v1/jobs/{job}"] * 3:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", u.jobs.port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            stalled.append(s)
        time.sleep(1.0)  # each has taken what the kernel holds and waits, reading nothing
        sent = time.monotonic()
        r = u.api.get(f"/v1/jobs/{job}/result", timeout=30)
        assert r.status_code == 200 and len(r.content) == 3 * 2**20, r.text[:200]
        poll = u.api.get(f"/v1/jobs/{job}", timeout=30)
        assert poll.status_code == 200 and len(poll.json()["result"]["image"]) == 4 * 2**20, poll.text[:200]
        assert time.monotonic() - sent < 5.0  # served before any stalled reader was cut (8 s)
        time.sleep(max(0.0, sent + 9.0 - time.monotonic()))  # past the send deadline, reading nothing
        for s in stalled:  # cut with a reset: what the kernel took, then the end of the connection
            s.settimeout(15)
            with pytest.raises(ConnectionResetError):
                while s.recv(1 << 20):
                    pass
        # a client's doing, not the server's: uvicorn logged an error for every answer cut short
        assert "without completing response" not in u.jobs.output() and "result was cut off" in u.jobs.output()
    finally:
        for s in stalled:
            s.close()
        u.stop()


# ---- Redis ---------------------------------------------------------------------------------
def redis_connections(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_redis_that_hangs_while_a_result_is_sent_ends_the_answer_short_without_a_traceback(tmp_path):
    """A result of several pieces is read from Redis as it is sent. Redis stopping mid-way
    (or any piece slower than op_timeout_s) cannot become a 503: the answer has begun. It
    ends short of its Content-Length, which the client sees; the log says so in a line (it
    was an ASGI traceback), and the service goes on."""
    srv = RedisServer(tmp_path)
    u = Unit(tmp_path, "stall", {"scripted": (TARGET_APP, {"model": "m1"})},
             queue={"url": srv.url, "prefix": "stall", "op_timeout_s": 1.0}, max_result_bytes=8_000_000)
    try:
        srv.start()
        start_units(u)
        job_id = u.submit("scripted", WORK, params={"tag": "big", "binary": 6_000_000})["id"]
        assert u.wait(job_id, timeout=60)["state"] == "succeeded"
        for path in (f"/v1/jobs/{job_id}/result", f"/v1/jobs/{job_id}"):  # as is, and inline in base64
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", u.jobs.port))
            try:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                time.sleep(1.0)  # the service is blocked on a full socket, mid-way through the result
                srv.pause()
                got, s_timeout = b"", time.monotonic() + 30
                s.settimeout(30)
                while chunk := s.recv(1 << 20):
                    got += chunk
                    assert time.monotonic() < s_timeout
            finally:
                srv.resume()
                s.close()
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            assert 0 < len(body) < length, (path, len(body), length)
        assert u.api.get("/healthz").status_code == 200
        assert u.api.get(f"/v1/jobs/{job_id}/result").content.__len__() == 6_000_000
        out = u.jobs.output()
        assert "Traceback" not in out and out.count("a result was cut off") >= 2, out[-3000:]
        assert "without completing response" not in out, out[-3000:]  # said once, as a warning
    finally:
        srv.resume()
        u.stop()
        srv.stop()  # (its own: every process a test starts, it stops)


def test_redis_that_hangs_gives_503_quickly_and_a_bounded_pool(tmp_path):
    srv = RedisServer(tmp_path)
    u = Unit(tmp_path, "stuck", targets={"scripted": (TARGET_APP, {"model": "m1"}),
                                          "bare": (TARGET_APP, {"model": "m2", "openapi": False})},
             target_settings={"bare": {"routes": [WORK]}},
             queue={"url": srv.url, "prefix": "stuck", "op_timeout_s": 1.0, "max_connections": 4})
    try:
        srv.start()
        start_units(u)
        idempotency_rules(u, "stuck-key")
        job_id = u.submit("scripted", WORK, params={"tag": "before"})["id"]
        assert u.wait(job_id)["state"] == "succeeded"
        srv.pause()
        for method, path, body in (("POST", "/v1/jobs", {"service": "scripted", "route": WORK, "params": {}}),
                                   ("GET", f"/v1/jobs/{job_id}", None), ("GET", f"/v1/jobs/{job_id}/result", None),
                                   ("DELETE", f"/v1/jobs/{job_id}", None)):
            t0 = time.monotonic()
            r = u.api.request(method, path, json=body, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 503, (path, r.text)
            assert error_of(r)["code"] == "queue_unavailable" and r.headers["retry-after"], r.text
            assert took < 2.5, (path, took)  # op_timeout_s + slack; without a deadline: 3 tries of 1 s
        # a flood while Redis hangs: each request waits for one of 4 pooled connections
        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            futs = [pool.submit(httpx.get, f"{u.jobs.url}/v1/jobs/{job_id}", timeout=30) for _ in range(48)]
            peak = 0
            while not all(f.done() for f in futs):
                peak = max(peak, redis_connections(u.jobs.proc.pid, srv.port))
                time.sleep(0.02)
            codes = {f.result().status_code for f in futs}
        assert codes == {503}, codes
        # 4 pooled + one blocking read per consumer (2) + the cancel listener
        assert 0 < peak <= 4 + 2 + 1, peak
        srv.resume()
        deadline = time.monotonic() + 15
        while u.api.get(f"/v1/jobs/{job_id}").status_code != 200:
            assert time.monotonic() < deadline, u.jobs.output()
            time.sleep(0.1)
        assert u.wait(u.submit("scripted", WORK, params={"tag": "after"})["id"])["state"] == "succeeded"
    finally:
        srv.resume()
        u.stop()
        srv.stop()  # (its own: every process a test starts, it stops)
        srv.stop()


def test_a_full_redis_refuses_submits_with_503_and_the_unit_goes_on(tmp_path):
    """Redis at its maxmemory under noeviction (as the manifest runs it) refuses writes: a submit
    is a 503 in the envelope, what is stored still reads, and once memory is back jobs run."""
    import redis

    srv = RedisServer(tmp_path)
    u = Unit(tmp_path, "full", targets={"scripted": (TARGET_APP, {"model": "m1"})},
             queue={"url": srv.url, "prefix": "full", "op_timeout_s": 2.0}, queue_wait_s=0.5)
    admin = None
    try:
        srv.start()
        start_units(u)
        done = u.submit("scripted", WORK, params={"tag": "before"})["id"]
        assert u.wait(done)["state"] == "succeeded"
        running = u.submit("scripted", WORK, params={"tag": "long", "sleep_s": 3})["id"]
        u.wait(running, states={"running"})
        admin = redis.Redis(port=srv.port)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        for _ in range(3):
            r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "params": {"tag": "full"}},
                           timeout=30)
            assert r.status_code == 503, r.text
            err = error_of(r)
            assert err["code"] == "queue_full" and "maxmemory" in err["message"] and r.headers["retry-after"], r.text
        assert u.api.get(f"/v1/jobs/{done}").json()["state"] == "succeeded"
        # the unit says so: not ready, a metric, a log line
        ready = u.api.get("/readyz")
        assert ready.status_code == 503 and "refuses writes" in ready.json()["reason"], ready.text
        assert "onecard_jobs_queue_writable 0.0" in u.api.get("/metrics").text
        assert "Redis refuses writes (maxmemory" in u.jobs.output()
        # an accepted job still moves on: a cancel (it was a 500, then a 503) ends it
        r = u.api.delete(f"/v1/jobs/{running}", timeout=30)
        assert r.status_code == 202, r.text
        assert u.wait(running)["state"] == "cancelled"
        assert u.jobs.alive
        admin.config_set("maxmemory", 0)
        assert u.wait(u.submit("scripted", WORK, params={"tag": "after"})["id"])["state"] == "succeeded"
        assert u.api.get("/readyz").status_code == 200
        assert "onecard_jobs_queue_writable 1.0" in u.api.get("/metrics").text
    finally:
        if admin is not None:
            admin.close()
        u.stop()
        srv.stop()


# ---- start-up --------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, ""])
def test_a_queue_url_variable_that_is_missing_stops_the_start(tmp_path, value):
    env = {} if value is None else {"ONECARD_TEST_JOBS_QUEUE_URL": value}
    p = Proc("jobs", JOBS_APP, {"queue": {"url_env": "ONECARD_TEST_JOBS_QUEUE_URL"}}, tmp_path, env=env)
    if value is None:
        p.env.pop("ONECARD_TEST_JOBS_QUEUE_URL", None)
    p.start()
    try:
        code = p.proc.wait(timeout=60)
        out = p.output()
        assert code == 78, out
        assert "ONECARD_TEST_JOBS_QUEUE_URL" in out and "queue.url_env" in out, out
        assert "Traceback" not in out, out
    finally:
        p.kill()


def test_the_supervisor_stops_the_unit_with_78_when_the_queue_url_variable_is_missing(tmp_path):
    jobs = {"app": JOBS_APP, "port": free_port(), "threads": 1, "env": {"PYTHONPATH": str(ROOT)},
            "settings": {"queue": {"url_env": "ONECARD_TEST_JOBS_QUEUE_URL"}}}
    with SupervisorRun(tmp_path, {"jobs": jobs, "other": fake_service()}) as run:
        assert run.wait_exit(60) == 78
        out = run.output()
        assert "jobs: exited with code 78; stopping every service" in out, out
        assert "queue.url_env: the environment variable ONECARD_TEST_JOBS_QUEUE_URL is not set" in out, out
        assert not run.wait_no_leftovers()

"""The jobs queue keeps its promises under faults, with real processes and a real Redis:
a job that crashes its service costs only itself; a unit stalled past its lease cannot
write; a Redis that lost its data gets its registry back and the loss is reported; an
Idempotency-Key outlives its job's record; a Redis at maxmemory never leaves an accepted
job queued, and what cannot be stored is refused at submit."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import pytest
import redis

from tests.jobs_harness import TARGET_APP, Restarter, Unit, start_units
from tests.redis_server import RedisServer

WORK = "/api/v1/work"


def journal(path) -> list[tuple[str, str]]:
    try:
        return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


def wait_for(predicate, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_job_that_crashes_its_service_costs_only_itself(tmp_path):
    """Two innocent jobs in flight beside one that kills the service: all three run again
    alone, one at a time; the innocents succeed with one attempt, the crasher is charged
    one attempt per crash while alone and dead-lettered after max_attempts."""
    log = tmp_path / "journal"
    u = Unit(tmp_path, "crashy", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "journal": str(log)})},
             target_settings={"scripted": {"max_in_flight": 3}},
             queue={"max_attempts": 3, "retry_backoff_s": 0.1, "retry_backoff_max_s": 0.2})
    restarter = None
    try:
        start_units(u)
        restarter = Restarter(u.targets["scripted"])
        innocents = [u.submit("scripted", WORK, body={"tag": f"innocent-{i}", "sleep_s": 1.5})["id"] for i in (1, 2)]
        wait_for(lambda: sum(e == "started" for e, _ in journal(log)) == 2, what="the innocents never started")
        crasher = u.submit("scripted", WORK, body={"tag": "crasher", "crash": True})["id"]
        for job_id in innocents:
            done = u.wait(job_id, timeout=60)
            assert done["state"] == "succeeded" and done["attempts"] == 1 and done["error"] is None, done
        dead = u.wait(crasher, timeout=60)
        assert dead["state"] == "failed" and dead["dead_lettered"] and dead["attempts"] == 3, dead
        assert dead["error"]["code"] == "service_crashed"
        events = journal(log)
        starts = [tag for e, tag in events if e == "started"]
        assert starts.count("crasher") == 4  # once among others (not charged), then three times alone
        assert starts.count("innocent-1") == starts.count("innocent-2") == 2
        # the re-runs after the crash were alone: each one finished before the next started
        after = events[[i for i, (e, t) in enumerate(events) if t == "crasher"][0] + 1:]
        for i, (event, tag) in enumerate(after):
            if event == "started" and tag != "crasher":
                assert after[i + 1] == ("finished", tag), after
        counts = {line.split(" ")[0]: line.split(" ")[1] for line in u.api.get("/metrics").text.splitlines()
                  if line.startswith("onecard_jobs_total{")}
        assert counts['onecard_jobs_total{state="isolated"}'] == "3.0", counts
        assert counts['onecard_jobs_total{state="crashed"}'] == "6.0", counts  # 3 runs cut at once, then 3 alone
        wait_for(lambda: restarter.restarts == 4, what="four crashes, four restarts")  # the last may be under way
    finally:
        if restarter is not None:
            restarter.stop()
        u.stop()


def test_a_job_sent_while_its_service_is_down_waits_for_it_and_costs_no_attempt(tmp_path):
    """Connection refused: the request never reached the service (it is restarting), so the
    job is sent again once the service is back, with its attempts untouched."""
    log = tmp_path / "journal"
    u = Unit(tmp_path, "down", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "journal": str(log)})},
             queue={"max_attempts": 1})
    restarter = None
    try:
        start_units(u)
        restarter = Restarter(u.targets["scripted"], delay_s=1.5)
        u.targets["scripted"].kill()  # down while idle: the jobs service has not noticed
        job_id = u.submit("scripted", WORK, body={"tag": "patient"})["id"]
        done = u.wait(job_id, timeout=30)
        assert done["state"] == "succeeded" and done["attempts"] == 1 and done["runs"] == 1, done
        assert restarter.restarts == 1 and [t for e, t in journal(log) if e == "started"] == ["patient"]
    finally:
        if restarter is not None:
            restarter.stop()
        u.stop()


class UnitRestarter:
    """A unit run as the supervisor runs one: when its model service dies, the jobs service
    gets SIGTERM (a drain) and the whole unit exits; the orchestrator starts it again."""

    def __init__(self, unit: Unit):
        self.unit, self.restarts = unit, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        target = next(iter(self.unit.targets.values()))
        while not self._stop.wait(0.02):
            if target.proc.poll() is None:
                continue
            self.unit.jobs.proc.send_signal(signal.SIGTERM)
            try:
                self.unit.jobs.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.unit.jobs.kill()
            if self._stop.is_set():
                return
            self.restarts += 1
            self.unit.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_on_a_unit_that_restarts_whole_the_crasher_is_dead_lettered_and_the_others_succeed(server, tmp_path):
    log = tmp_path / "journal"
    u = Unit(tmp_path, "whole", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "journal": str(log)})},
             target_settings={"scripted": {"max_in_flight": 3}}, drain_s=1.0,
             queue={"url": server.url, "prefix": "whole", "max_attempts": 2, "retry_backoff_s": 0.1,
                    "visibility_timeout_s": 2.0})
    restarter = None
    try:
        start_units(u)
        restarter = UnitRestarter(u)
        innocent = u.submit("scripted", WORK, body={"tag": "innocent", "sleep_s": 1.0})["id"]
        wait_for(lambda: ("started", "innocent") in journal(log), what="the innocent never started")
        crasher = u.submit("scripted", WORK, body={"tag": "crasher", "crash": True})["id"]

        def finished(job_id: str) -> dict:
            seen: dict = {}

            def check() -> bool:
                try:  # the unit is down now and then: that is the point
                    seen.update(u.job(job_id, result="false"))
                except (httpx.TransportError, AssertionError):
                    return False
                return seen["state"] in ("succeeded", "failed", "cancelled")
            wait_for(check, timeout=90, what=f"{job_id} never finished: {seen}")
            return seen
        dead = finished(crasher)
        assert dead["state"] == "failed" and dead["dead_lettered"] and dead["attempts"] == 2, dead
        done = finished(innocent)
        assert done["state"] == "succeeded" and done["attempts"] == 1, done
        starts = [t for e, t in journal(log) if e == "started"]
        assert starts.count("crasher") == 3, starts  # among others once (not charged), then alone twice
    finally:
        if restarter is not None:
            restarter.stop()
        u.stop()


def test_a_job_whose_service_stays_down_goes_back_to_the_queue_uncharged(server, tmp_path):
    queue = {"url": server.url, "prefix": "away", "max_attempts": 1}
    units = [Unit(tmp_path, f"unit-{n}", {"scripted": (TARGET_APP, {"model": "m1", "unit": n, "dry_run": True})},
                  queue=queue, backpressure_requeue_s=1.0) for n in ("x", "y")]
    try:
        start_units(units[0])
        units[0].targets["scripted"].kill()  # down for good, unnoticed until a job is sent
        job_id = units[0].submit("scripted", WORK, body={"tag": "orphan"})["id"]
        wait_for(lambda: (j := units[0].job(job_id))["runs"] >= 1 and j["state"] == "queued",
                 what="the job was never handed back")
        start_units(units[1])
        done = units[1].wait(job_id, timeout=30)
        assert done["state"] == "succeeded" and done["node"] == "unit-y" and done["attempts"] == 1, done
    finally:
        for u in units:
            u.stop()


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path) as srv:
        yield srv


def test_a_unit_stalled_past_its_lease_cannot_write_and_the_record_names_the_writer(server, tmp_path):
    queue = {"url": server.url, "prefix": "fence", "visibility_timeout_s": 1.0}
    units = [Unit(tmp_path, f"unit-{n}", {"scripted": (TARGET_APP, {"model": "m1", "unit": n, "dry_run": True})},
                  target_settings={"scripted": {"max_in_flight": 1}}, queue=queue) for n in ("x", "y")]
    stalled = None
    try:
        start_units(*units)
        job = units[0].submit("scripted", WORK, body={"tag": "fenced", "sleep_s": 2.5})
        running = units[0].wait(job["id"], ("running",))
        stalled = next(u for u in units if u.node == running["node"])
        other = next(u for u in units if u is not stalled)
        stalled.jobs.proc.send_signal(signal.SIGSTOP)  # its service goes on and answers meanwhile
        done = other.wait(job["id"], timeout=30)
        assert done["state"] == "succeeded" and done["node"] == other.node and done["runs"] == 2, done
        assert done["result"]["unit"] == other.node[-1]
        stalled.jobs.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: 'onecard_jobs_total{state="fenced"} 1.0' in stalled.api.get("/metrics").text,
                 what="the stalled unit never noticed it lost the job")
        again = other.job(job["id"])
        assert again == done and again["result"]["unit"] == other.node[-1]
        raw = other.api.get(f"/v1/jobs/{job['id']}/result").json()
        assert raw["unit"] == other.node[-1]
        assert "taken over by another unit" in stalled.jobs.output() or "this run's outcome is dropped" in \
            stalled.jobs.output()
    finally:
        if stalled is not None:
            stalled.jobs.proc.send_signal(signal.SIGCONT)
        for u in units:
            u.stop()


def test_a_redis_that_lost_its_data_gets_its_registry_back_and_the_loss_is_reported(server, tmp_path):
    queue = {"url": server.url, "prefix": "lost", "announce_period_s": 0.3}
    api_only = Unit(tmp_path, "api", {}, queue=queue, consume=False)
    worker = Unit(tmp_path, "worker", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True})}, queue=queue)
    try:
        start_units(worker, api_only)
        assert worker.wait(api_only.submit("scripted", WORK, body={"tag": "before"})["id"])["state"] == "succeeded"
        server.restart()  # no persistence: every key is gone
        wait_for(lambda: api_only.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {
            "tag": "probe"}}).status_code == 202, what="the API-only unit never learnt the model again")
        job = api_only.submit("scripted", WORK, body={"tag": "after"})
        assert worker.wait(job["id"])["state"] == "succeeded"
        for unit in (worker, api_only):
            wait_for(lambda unit=unit: 'onecard_jobs_queue_events_total{event="data_lost"} 1.0' in unit.api.get(
                "/metrics").text, what=f"{unit.node} did not report the loss")
            assert "the queue lost its data" in unit.jobs.output()
            assert unit.stats()["jobs"]["queue_data_lost_at"] is not None
            assert unit.api.get("/info").json()["registry"]["data_losses"] == 1
        assert "announced again" in worker.jobs.output()
    finally:
        api_only.stop()
        worker.stop()


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_an_idempotency_key_is_kept_for_its_own_time_not_its_jobs(tmp_path, backend):
    srv = RedisServer(tmp_path).start() if backend == "redis" else None
    queue = {"results_ttl_s": 1.0, "idempotency_ttl_s": 3600, **({"url": srv.url} if srv else {})}
    log = tmp_path / "journal"
    u = Unit(tmp_path, "idem", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "journal": str(log)})},
             queue=queue)
    try:
        start_units(u)
        h = {"Idempotency-Key": "order-77"}
        first = u.submit("scripted", WORK, headers=h, body={"tag": "once"})
        assert u.wait(first["id"])["state"] == "succeeded"
        wait_for(lambda: u.api.get(f"/v1/jobs/{first['id']}").status_code == 404, what="the record never expired")
        again = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {"tag": "once"}},
                           headers=h)
        assert again.status_code == 202 and again.json()["id"] == first["id"], again.text
        assert again.headers["idempotent-replayed"] == "true" and again.json()["state"] == "expired"
        other = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {"tag": "twice"}},
                           headers=h)
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
        time.sleep(0.5)
        assert [t for e, t in journal(log) if e == "started"] == ["once"]  # the model ran once
    finally:
        u.stop()
        if srv is not None:
            srv.stop()


def test_a_full_redis_never_leaves_an_accepted_job_queued(tmp_path):
    """Redis at maxmemory 30mb (noeviction), jobs with 3 MB bodies that answer 6 MB: a submit
    reserves room for its result (the dry run's cost.output_bytes), so what cannot be stored
    is refused at submit, and every accepted job finishes while the unit stays ready."""
    with RedisServer(tmp_path) as srv:
        admin = redis.Redis(port=srv.port)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 30 * 2**20)
        u = Unit(tmp_path, "full", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "cost": True,
                                                      "max_body_bytes": 8 * 2**20})},
                 queue={"url": srv.url, "prefix": "mm"}, max_body_bytes=8 * 2**20, queue_wait_s=0.5)
        try:
            start_units(u)
            codes, accepted = [], []
            for i in range(7):
                r = u.api.post("/v1/jobs", json={"service": "scripted", "route": WORK, "body": {
                    "tag": f"big-{i}", "p": "x" * (3 * 2**20), "binary": 6 * 2**20, "sleep_s": 0.5}}, timeout=60)
                codes.append(r.status_code)
                if r.status_code == 202:
                    accepted.append(r.json()["id"])
                else:
                    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
                    assert "no room" in r.json()["error"]["message"] and r.headers["retry-after"]
            assert 1 <= len(accepted) < 7, codes
            for job_id in accepted:
                done = u.wait(job_id, timeout=60)
                assert done["state"] == "succeeded", done
                raw = u.api.get(f"/v1/jobs/{job_id}/result", timeout=60)
                assert raw.status_code == 200 and len(raw.content) == 6 * 2**20
            assert u.api.get("/readyz").status_code == 200
            assert int(admin.info("memory")["used_memory"]) <= 30 * 2**20
            assert "onecard_jobs_queue_writable 1.0" in u.api.get("/metrics").text
        finally:
            admin.close()
            u.stop()


def test_results_are_streamed_to_many_pollers_that_do_not_read(tmp_path):
    import socket

    import psutil

    u = Unit(tmp_path, "polls", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True})}, max_result_streams=64,
             result_send_timeout_s=30)
    socks = []
    try:
        start_units(u)
        size = 24 * 2**20
        job_id = u.submit("scripted", WORK, body={"tag": "big", "binary": size})["id"]
        assert u.wait(job_id, timeout=60)["state"] == "succeeded"
        rss = psutil.Process(u.jobs.proc.pid)
        before = rss.memory_info().rss
        for _ in range(40):  # each asks for the result inline (36 MB of JSON) and reads nothing
            s = socket.create_connection(("127.0.0.1", u.jobs.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(f"GET /v1/jobs/{job_id} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            socks.append(s)
        time.sleep(2)
        grown = rss.memory_info().rss - before
        assert grown < 120 * 2**20, f"RSS grew by {grown / 2**20:.0f} MB for 40 stalled polls"
        health = httpx.get(u.jobs.url + "/healthz", timeout=5)
        assert health.status_code == 200
        r = u.api.get(f"/v1/jobs/{job_id}", timeout=60)  # a poller that reads gets the whole document
        assert r.status_code == 200 and len(r.json()["result"]["image"]) == 4 * ((size + 2) // 3)
        assert int(r.headers["content-length"]) == len(r.content)
    finally:
        for s in socks:
            s.close()
        u.stop()


def test_after_a_redis_outage_longer_than_the_lease_a_unit_keeps_its_own_running_job(tmp_path):
    """Redis killed while a job runs and back from its AOF past visibility_timeout_s: no renewal
    got through, so the entry was idle past the timeout, and the unit took its own running
    job over: it started it again (a second model run) and dropped the first run's result
    (helper-46). The unit is alive: its run goes on, writes once Redis is back, and is the only one."""
    log = tmp_path / "journal.log"
    with RedisServer(tmp_path, aof=True) as server:
        queue = {"url": server.url, "prefix": "outage", "visibility_timeout_s": 1.0}
        unit = Unit(tmp_path, "unit", {"scripted": (TARGET_APP, {"model": "m1", "dry_run": True, "journal": str(log)})},
                    queue=queue)
        try:
            start_units(unit)
            job = unit.submit("scripted", WORK, body={"tag": "kept", "sleep_s": 4.0})
            unit.wait(job["id"], ("running",))
            server.kill()
            time.sleep(2.5)  # past the visibility timeout, with no renewal
            server.start()
            done = unit.wait(job["id"], timeout=60)
            assert done["state"] == "succeeded" and done["runs"] == 1, done
            assert [t for e, t in journal(log) if e == "started"] == ["kept"], unit.jobs.output()[-4000:]
            assert "this run's outcome is dropped" not in unit.jobs.output(), unit.jobs.output()[-3000:]
        finally:
            unit.stop()

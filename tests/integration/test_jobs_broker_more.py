"""More of the queue's specification, run against both backends (the embedded one and Redis
Streams on a real redis-server): retries after a backoff with jitter, priority levels (FIFO
within a level), Idempotency-Keys that outlive their job, the paginated listing, the
dead-letter redrive. Redis only: the memory budget (a job's body and the room for its
result reserved at submit), a Redis at its maxmemory that still lets accepted jobs finish,
and a registry rebuilt after Redis lost its data."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from services.jobs.broker import IdempotencyMismatch, JobTooLarge, ModelInfo, QueueFull
from services.jobs.policy import RetryPolicy
from services.jobs.records import Outcome, error_doc
from tests.integration.test_jobs_broker import LABEL, job, run, take_one

pytest_plugins = ("tests.integration.test_jobs_broker",)  # its fixtures: server, make

redis_only = pytest.mark.parametrize("make", ["redis"], indirect=True)


def test_a_failed_attempt_comes_back_after_its_backoff_not_at_once(make):
    async def scenario():
        policy = RetryPolicy(max_attempts=3, backoff_s=0.8, backoff_max_s=10, jitter=0.5, rng=lambda: 0.0)
        b = await make(policy=policy)
        j = job()
        await b.submit(j, LABEL)
        d = await take_one(b)
        t0 = time.monotonic()
        assert await b.requeue(d, error_doc("boom", "500", 500), charged=True) == "requeued"
        fields = await b.get(j.id)
        assert fields["state"] == "queued" and float(fields["retry_at"]) > time.time()
        stats = (await b.stream_stats([LABEL]))[0]
        assert (stats["lag"], stats["delayed"]) == (0, 1)
        assert await b.take(LABEL, 1, 0.3) == []  # still backing off
        d2 = await take_one(b, block_s=3)
        assert time.monotonic() - t0 >= 0.75 and d2.attempt == 2
        # a hand-back that is not the job's fault (backpressure, a drain) is not delayed
        assert await b.requeue(d2, None, charged=False) == "requeued"
        assert (await take_one(b, block_s=0.3)).attempt == 2
    run(make, scenario)


def test_higher_priority_levels_run_first_and_each_level_is_fifo(make):
    async def scenario():
        b = await make()
        order = [("low", "l1"), ("normal", "n1"), ("high", "h1"), ("low", "l2"), ("high", "h2"), ("normal", "n2")]
        ids = {}
        for level, name in order:
            j = job()
            j.priority = level
            ids[j.id] = name
            await b.submit(j, LABEL)
        taken = []
        for _ in order:
            d = await take_one(b)
            taken.append(ids[d.job_id])
            assert await b.finish(d, Outcome("succeeded", b"", "text/plain", 200)) == "ok"
        assert taken == ["h1", "h2", "n1", "n2", "l1", "l2"]
        assert (await b.get(d.job_id))["priority"] == "low"
    run(make, scenario)


def test_an_idempotency_key_outlives_its_job_record(make):
    async def scenario():
        b = await make(results_ttl_s=0.3, idempotency_ttl_s=60)
        first = job(key="order-9")
        assert (await b.submit(first, LABEL)).created
        d = await take_one(b)
        assert await b.finish(d, Outcome("succeeded", b"x", "text/plain", 200)) == "ok"
        await asyncio.sleep(0.6)
        assert await b.get(first.id) is None  # the record expired
        again = await b.submit(job(key="order-9"), LABEL)
        assert (again.id, again.created, again.state) == (first.id, False, "expired")
        with pytest.raises(IdempotencyMismatch):
            await b.submit(job(body=b'{"other":1}', key="order-9"), LABEL)
        assert await b.take(LABEL, 1, 0.2) == []  # nothing ran again
    run(make, scenario)


def test_listing_pages_through_a_state_oldest_first(make):
    async def scenario():
        b = await make()
        ids = []
        for _ in range(7):
            j = job()
            ids.append(j.id)
            await b.submit(j, LABEL)
        seen, cursor = [], None
        while True:
            page, cursor = await b.list_jobs(LABEL, "queued", 3, cursor)
            assert len(page) <= 3
            seen += [f["id"] for f in page]
            if cursor is None:
                break
        assert seen == ids
        for _ in range(2):
            d = await take_one(b)
            await b.finish(d, Outcome("succeeded", b"", "text/plain", 200))
        running = await take_one(b)
        assert [f["id"] for f in (await b.list_jobs(LABEL, "succeeded", 10, None))[0]] == ids[:2]
        assert [f["id"] for f in (await b.list_jobs(LABEL, "running", 10, None))[0]] == [running.job_id]
        assert [f["id"] for f in (await b.list_jobs(LABEL, "queued", 10, None))[0]] == ids[3:]
        with pytest.raises(ValueError):
            await b.list_jobs(LABEL, "queued", 10, "not-a-cursor")
    run(make, scenario)


def test_a_dead_lettered_job_is_redriven_with_its_attempts_reset(make):
    async def scenario():
        b = await make(max_attempts=1)
        j, ok = job(), job()
        await b.submit(j, LABEL)
        await b.submit(ok, LABEL)
        d = await take_one(b)
        assert await b.requeue(d, error_doc("boom", "500", 500), charged=True) == "dead"
        assert await b.redrive(ok.id) == "not_dead" and await b.redrive("f" * 32) == "missing"
        dead, _ = await b.list_jobs(LABEL, "dead", 10, None)
        assert [f["id"] for f in dead] == [j.id] and dead[0]["dead"] == "1"
        assert await b.redrive(j.id) == "ok"
        fields = await b.get(j.id)
        assert (fields["state"], fields["attempts"], fields.get("dead", "")) == ("queued", "0", "")
        assert (await b.list_jobs(LABEL, "dead", 10, None))[0] == []
        taken = {(await take_one(b)).job_id, (await take_one(b)).job_id}
        assert taken == {j.id, ok.id}
        assert (await b.get(j.id))["state"] == "running" and await b.redrive(j.id) == "not_dead"
    run(make, scenario)


# ---- Redis only ---------------------------------------------------------------------------
def used_memory(server) -> int:
    with redis.Redis.from_url(server.url) as admin:
        return int(admin.info("memory")["used_memory"])


@redis_only
def test_a_submit_reserves_room_for_its_result_and_what_cannot_be_stored_is_refused(make, server):
    async def scenario():
        budget = 10 * 2**20  # above what the shared Redis holds already
        b = await make(max_memory_bytes=used_memory(server) + budget)
        big = job(body=b"x" * 100)
        big.reserve = used_memory(server) + budget
        with pytest.raises(JobTooLarge):
            await b.submit(big, LABEL)
        accepted = []
        for _ in range(10):
            j = job(body=b"y" * 2**20)
            j.reserve = 2**20
            try:
                await b.submit(j, LABEL)
            except QueueFull as exc:
                assert "no room" in str(exc)
                break
            accepted.append(j)
        assert 2 <= len(accepted) <= budget // (2 * 2**20) + 1
        # every accepted job's result is stored, in what was reserved for it
        for _ in accepted:
            d = await take_one(b)
            assert await b.finish(d, Outcome("succeeded", b"r" * 2**20, "text/plain", 200)) == "ok"
            assert len(await b.result(d.job_id)) == 2**20
        with redis.Redis.from_url(server.url) as admin:
            assert int(admin.get(f"{make.prefix}:reserved")) == 0
    run(make, scenario)


@redis_only
def test_a_result_over_its_reserve_is_stored_only_when_the_queue_has_room(make, server):
    async def scenario():
        b = await make(max_memory_bytes=used_memory(server) + 8 * 2**20)
        small, big = job(), job()
        small.reserve = big.reserve = 1000
        await b.submit(small, LABEL)
        await b.submit(big, LABEL)
        d = await take_one(b)
        assert await b.finish(d, Outcome("succeeded", b"s" * 2**20, "text/plain", 200)) == "ok"  # room enough
        d = await take_one(b)
        assert await b.finish(d, Outcome("succeeded", b"b" * 9 * 2**20, "text/plain", 200)) == "no_room"
        fields = await b.get(d.job_id)
        assert fields["state"] == "failed" and "result_too_large" in fields["error"]
        assert await b.result(d.job_id) is None
    run(make, scenario)


@redis_only
def test_a_redis_at_its_maxmemory_refuses_new_jobs_but_accepted_ones_run_to_the_end(make, server):
    admin = redis.Redis.from_url(server.url)

    async def scenario():
        b = await make()
        jobs = [job() for _ in range(3)]
        for j in jobs:
            await b.submit(j, LABEL)
        d = await take_one(b)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        try:
            with pytest.raises(QueueFull):
                await b.submit(job(), LABEL)
            assert "maxmemory" in (await b.refuses_writes() or "")
            assert await b.renew(LABEL, [d]) == {d.job_id: "ok"}
            assert await b.finish(d, Outcome("succeeded", b"r" * 50_000, "text/plain", 200)) == "ok"
            d2 = await take_one(b)
            assert await b.requeue(d2, error_doc("boom", "x", 500), charged=True) == "requeued"
            for _ in range(2):
                d3 = await take_one(b)
                assert await b.finish(d3, Outcome("succeeded", b"", "text/plain", 200)) == "ok"
            assert {(await b.get(j.id))["state"] for j in jobs} == {"succeeded"}
            assert b.refusals and b.refusal
        finally:
            admin.config_set("maxmemory", 0)
        assert await b.refuses_writes() is None
        await b.submit(job(), LABEL)
    try:
        run(make, scenario)
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()


@redis_only
def test_the_registry_is_rebuilt_after_redis_loses_its_data_and_the_loss_is_seen(make, server):
    async def scenario():
        b = await make()
        info = ModelInfo(LABEL, "svc", ["/r"], {"max_pixels": 10})
        assert await b.announce(info) is True
        assert await b.announce(info) is False
        newer = ModelInfo(LABEL, "svc", ["/r", "/s"], {})  # another unit of the pool, another version
        assert await b.announce(newer) is False and (await b.models())[LABEL].routes == ["/r", "/s"]
        assert await b.announce(info) is False
        epoch = await b.epoch()
        assert await b.epoch() == epoch
        redis.Redis.from_url(server.url).flushall()
        assert await b.announce(info) is True
        assert (await b.models())[LABEL].routes == ["/r"]
        assert await b.epoch() != epoch
        await b.submit(job(), LABEL)  # the consumer groups are back too
        assert (await take_one(b)).attempt == 1
    run(make, scenario)


@pytest.mark.parametrize("make", ["memory"], indirect=True)
def test_the_embedded_queue_bounds_its_idempotency_keys(make):
    async def scenario():
        b = await make(max_idempotency_keys=2)
        first = await b.submit(job(key="k1"), LABEL)
        await b.submit(job(key="k2"), LABEL)
        assert (await b.submit(job(key="k1"), LABEL)).id == first.id  # still remembered
        await b.submit(job(key="k3"), LABEL)  # k1, the oldest (it would expire first too), is forgotten
        assert len(b.idem) == 2
        assert not (await b.submit(job(key="k2"), LABEL)).created
        assert (await b.submit(job(key="k1"), LABEL)).created
    run(make, scenario)

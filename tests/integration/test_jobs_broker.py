"""The queue semantics, one specification run against both backends: the embedded one and
Redis Streams on a real redis-server (in-process asyncio clients, no service processes).
Redis-only cases: leases, take-over after the visibility timeout, a late finish after a
take-over, and a lag that stays readable for KEDA."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import socket
import time

import pytest
import redis

from services.jobs.broker import IdempotencyMismatch, QueueFull
from services.jobs.memory_broker import MemoryBroker
from services.jobs.policy import RetryPolicy
from services.jobs.records import Delivery, NewJob, Outcome, error_doc, new_id
from services.jobs.redis_broker import RedisBroker
from services.jobs.settings import QueueSettings
from tests.redis_server import RedisServer

LABEL = "svc/backend/model"
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("broker-redis")) as srv:
        yield srv


@pytest.fixture(params=["memory", "redis"])
def make(request):
    """make(node, **queue settings) -> a started broker; every one is closed after the test."""
    made = []
    prefix = f"b{next(_prefixes)}"
    server = request.getfixturevalue("server") if request.param == "redis" else None

    async def factory(node: str = "n1", max_queued: int = 100, policy: RetryPolicy | None = None,
                      **queue) -> MemoryBroker | RedisBroker:
        settings = QueueSettings(prefix=prefix, **{"retry_backoff_s": 0, **queue})
        if server is None:
            broker = MemoryBroker(settings, node, max_queued, policy)
        else:
            broker = RedisBroker(server.url, settings, node, max_queued, policy)
        await broker.start()
        made.append(broker)
        return broker

    factory.kind = request.param
    factory.prefix = prefix
    factory.closers = made
    return factory


def run(make, scenario):
    async def main():
        try:
            await scenario()
        finally:
            for b in make.closers:
                await b.close()
    asyncio.run(main())


def job(body: bytes = b'{"x":1}', key: str | None = None) -> NewJob:
    return NewJob(new_id(), "svc", "/r", LABEL, body, hashlib.sha256(body).hexdigest(), key, time.time())


async def take_one(broker, block_s: float = 2.0) -> Delivery:
    got = await broker.take(LABEL, 1, block_s)
    assert len(got) == 1, got
    return got[0]


def test_submit_take_finish_and_exactly_one_result(make):
    async def scenario():
        b = await make()
        j = job()
        sub = await b.submit(j, LABEL)
        assert sub.created and sub.state == "queued"
        assert (await b.stream_stats([LABEL]))[0]["lag"] == 1
        d = await take_one(b)
        assert (d.job_id, d.route, d.body, d.attempt) == (j.id, "/r", j.body, 1)
        assert (await b.get(j.id))["state"] == "running"
        stats = (await b.stream_stats([LABEL]))[0]
        assert (stats["lag"], stats["pending"]) == (0, 1)
        assert await b.finish(d, Outcome("succeeded", b"answer", "application/json", 200, {"x-seed": "3"})) == "ok"
        assert await b.finish(d, Outcome("succeeded", b"second", "application/json", 200)) == "duplicate"
        fields = await b.get(j.id)
        assert fields["state"] == "succeeded" and fields["result_type"] == "application/json"
        assert await b.result(j.id) == b"answer"
        stats = (await b.stream_stats([LABEL]))[0]
        assert (stats["lag"], stats["pending"]) == (0, 0)
        assert await b.take(LABEL, 1, 0.2) == []  # nothing left, after a blocking wait
    run(make, scenario)


def test_idempotency_key(make):
    async def scenario():
        b = await make()
        first = await b.submit(job(key="k1"), LABEL)
        again = await b.submit(job(key="k1"), LABEL)
        assert first.created and not again.created and again.id == first.id
        with pytest.raises(IdempotencyMismatch):
            await b.submit(job(body=b'{"x":2}', key="k1"), LABEL)
        assert (await b.submit(job(key="k2"), LABEL)).id != first.id
        assert (await b.stream_stats([LABEL]))[0]["lag"] == 2
    run(make, scenario)


def test_queue_full(make):
    async def scenario():
        b = await make(max_queued=2)
        await b.submit(job(), LABEL)
        await b.submit(job(), LABEL)
        with pytest.raises(QueueFull):
            await b.submit(job(), LABEL)
    run(make, scenario)


def test_cancel_queued_is_never_taken_and_cancel_running_tells_the_runner(make):
    async def scenario():
        b = await make()
        told = asyncio.Event()
        heard: list[str] = []
        b.on_cancel(lambda job_id: (heard.append(job_id), told.set()))
        queued, running = job(), job()
        await b.submit(running, LABEL)
        d = await take_one(b)
        await b.submit(queued, LABEL)
        verdict, fields = await b.cancel(queued.id)
        assert verdict == "cancelled" and fields["state"] == "cancelled"
        assert await b.take(LABEL, 5, 0.3) == []
        assert (await b.stream_stats([LABEL]))[0]["lag"] == 0
        await asyncio.sleep(0.2)  # the cancel channel is subscribed
        verdict, fields = await b.cancel(running.id)
        assert verdict == "cancelling" and fields["state"] == "running" and fields["cancel"] == "1"
        await asyncio.wait_for(told.wait(), 5)
        assert heard == [running.id]
        assert await b.renew(LABEL, [d]) == {running.id: "cancel"}  # the fallback sees it too
        assert await b.finish(d, Outcome("cancelled", error=error_doc("cancelled", "stopped"))) == "ok"
        assert (await b.cancel(running.id))[0] == "cancelled"
    run(make, scenario)


def test_failed_attempts_are_retried_then_dead_lettered_with_the_last_error(make):
    async def scenario():
        b = await make(max_attempts=3)
        j = job()
        await b.submit(j, LABEL)
        for attempt in (1, 2, 3):
            d = await take_one(b)
            assert d.attempt == attempt
            verdict = await b.requeue(d, error_doc("boom", f"run {attempt}", 500), charged=True)
            assert verdict == ("requeued" if attempt < 3 else "dead")
        fields = await b.get(j.id)
        assert fields["state"] == "failed" and '"run 3"' in fields["error"]
        stats = (await b.stream_stats([LABEL]))[0]
        assert (stats["dead_lettered"], stats["lag"], stats["pending"]) == (1, 0, 0)
    run(make, scenario)


def test_a_job_handed_back_keeps_its_attempts_and_a_stale_hand_back_is_ignored(make):
    async def scenario():
        b = await make(max_attempts=1)
        j = job()
        await b.submit(j, LABEL)
        d = await take_one(b)
        assert await b.requeue(d, None, charged=False) == "requeued"  # backpressure or shutdown
        d2 = await take_one(b)
        assert d2.attempt == 1
        assert await b.requeue(d, error_doc("late", "stale"), charged=True) == "lost"  # the old delivery's lease
        assert (await b.get(j.id))["state"] == "running"
        assert await b.finish(d, Outcome("succeeded", b"stale", "text/plain", 200)) == "lost"
        assert await b.finish(d2, Outcome("succeeded", b"ok", "text/plain", 200)) == "ok"
        assert await b.result(j.id) == b"ok"
    run(make, scenario)


# leases and take-over exist only with many units: Redis
redis_only = pytest.mark.parametrize("make", ["redis"], indirect=True)


@redis_only
def test_a_job_whose_unit_stalls_is_taken_over_and_the_stalled_run_can_no_longer_write(make):
    """Fencing: the first unit keeps its lease while it renews it; once it stalls past the
    visibility timeout another unit takes the job with a new lease, and the stalled run's
    renew, finish and hand-back are all refused. The record names the run that wrote."""
    async def scenario():
        a = await make("unit-a", visibility_timeout_s=0.6)
        b = await make("unit-b", visibility_timeout_s=0.6)
        j = job()
        await a.submit(j, LABEL)
        da = await take_one(a)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # a keeps its lease alive past the visibility timeout
            assert await a.renew(LABEL, [da]) == {j.id: "ok"}
            assert await b.take(LABEL, 1, 0.1) == []
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.8)  # a stalls: no renewal for over the visibility timeout
        db = await take_one(b, block_s=3)
        assert db.job_id == j.id and db.runs == 2 and db.lease != da.lease
        assert db.attempt == 1 and db.isolate  # a lost run that was not alone is charged to nobody: it runs alone
        fields = await b.get(j.id)
        assert fields["node"] == "unit-b" and '"unit_lost"' in fields["last_error"]
        assert await a.renew(LABEL, [da]) == {j.id: "lost"}
        assert await a.finish(da, Outcome("succeeded", b"from-a", "text/plain", 200)) == "lost"
        assert await a.requeue(da, error_doc("late", "x"), charged=True) == "lost"
        assert (await b.get(j.id))["state"] == "running"
        assert await b.finish(db, Outcome("succeeded", b"from-b", "text/plain", 200)) == "ok"
        assert await a.result(j.id) == b"from-b"
        fields = await a.get(j.id)
        assert (fields["node"], fields["attempts"], fields["runs"]) == ("unit-b", "1", "2")
        assert fields["consumer"] == b.consumer
        stats = (await b.stream_stats([LABEL]))[0]
        assert (stats["lag"], stats["pending"]) == (0, 0)
    run(make, scenario)


@redis_only
def test_a_job_that_keeps_killing_its_units_running_alone_is_dead_lettered(make):
    """Losing a unit is charged to a job only when it ran alone (marked solo): the first loss
    (among others) costs nothing but isolates it; each solo loss is an attempt."""
    async def scenario():
        j = job()
        first = await make("u0", visibility_timeout_s=0.5, max_attempts=2)
        await first.submit(j, LABEL)
        await take_one(first)
        deliveries = []
        for n in range(1, 4):
            await asyncio.sleep(0.7)
            unit = await make(f"u{n}", visibility_timeout_s=0.5, max_attempts=2)
            if n == 3:
                assert await unit.take(LABEL, 1, 1.0) == []
                break
            d = await take_one(unit, block_s=2)
            deliveries.append(d)
            assert d.isolate and await unit.mark_solo(d)
        assert [d.attempt for d in deliveries] == [1, 2]
        fields = await unit.get(j.id)
        assert fields["state"] == "failed" and '"unit_lost"' in fields["error"] and fields["dead"] == "1"
        assert (await unit.stream_stats([LABEL]))[0]["dead_lettered"] == 1
    run(make, scenario)


@redis_only
def test_the_group_lag_stays_readable_through_cancels_and_finishes(make, server):
    """KEDA's lagCount scaler reads XINFO GROUPS lag; deleting undelivered entries would make it null."""
    async def scenario():
        b = await make()
        jobs = [job() for _ in range(6)]
        for j in jobs:
            await b.submit(j, LABEL)
        await b.cancel(jobs[2].id)
        d = await take_one(b)
        assert await b.finish(d, Outcome("succeeded", b"", "text/plain", 200)) == "ok"
        group = redis.Redis.from_url(server.url).xinfo_groups(f"{make.prefix}:stream:{LABEL}")[0]
        assert group["lag"] == 5 and group["pending"] == 0
    run(make, scenario)



def test_the_idle_pubsub_connection_has_tcp_keepalive(server):
    """The cancel/done listener reads with no timeout: only TCP keepalive notices a Redis that
    vanished without a reset (a partition), so that it reconnects instead of waiting forever."""
    async def main():
        broker = RedisBroker(server.url, QueueSettings(prefix=f"b{next(_prefixes)}"), "n1", 10)
        await broker.start()
        try:
            conns = []
            for _ in range(100):
                conns = [c for c in broker.listener.connection_pool._in_use_connections if c.is_connected]
                if conns:
                    break
                await asyncio.sleep(0.02)
            assert conns, "the listener never connected"
            sock = conns[0]._writer.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
        finally:
            await broker.close()

    asyncio.run(main())


def test_a_jobs_trace_context_is_a_field_of_its_record_and_records_without_one_still_run(make):
    """The submit's traceparent (and tracestate) comes back with every run, a retry's too; a
    record written without them (an older version, or traces off) runs with no trace."""
    traced = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "k=v"}

    async def scenario():
        b = await make(max_attempts=3)
        with_trace, without = job(b'{"t":1}'), job(b'{"t":2}')
        with_trace.trace = traced
        await b.submit(with_trace, LABEL)
        await b.submit(without, LABEL)
        first, second = await take_one(b), await take_one(b)
        assert (first.job_id, first.trace) == (with_trace.id, traced)
        assert (second.job_id, second.trace) == (without.id, None)
        assert (await b.get(with_trace.id))["traceparent"] == traced["traceparent"]
        assert "traceparent" not in await b.get(without.id)
        assert await b.requeue(first, error_doc("boom", "x"), True, False) == "requeued"
        again = await take_one(b)
        assert (again.job_id, again.attempt, again.trace) == (with_trace.id, 2, traced)
    run(make, scenario)


def test_a_take_that_fails_midway_leaves_what_it_started_to_be_taken_over(server):
    """A batch whose second START fails (Redis gone midway): the first job was started in Redis
    but is never run here. It must stay open to a takeover after the visibility timeout, by this
    unit too (helper-47): the set that keeps a unit from taking its own running jobs over had
    kept it, and on a one-unit deployment the job stayed 'running' for good."""
    async def scenario():
        b = RedisBroker(server.url, QueueSettings(prefix=f"b{next(_prefixes)}", visibility_timeout_s=0.5,
                                                  retry_backoff_s=0), "n1", 10)
        await b.start()
        try:
            jobs = [job(), job()]
            for j in jobs:
                await b.submit(j, LABEL)
            real_call, starts = b._call, []

            async def failing_second_start(name, *args, **kwargs):
                if name == "START":
                    starts.append(name)
                    if len(starts) == 2:
                        raise ConnectionError("redis went away")
                return await real_call(name, *args, **kwargs)
            b._call = failing_second_start
            with pytest.raises(Exception):  # noqa: B017 - whatever the deadline wrapper makes of it
                await b.take(LABEL, 2, 0.2)
            b._call = real_call
            assert (await b.get(jobs[0].id))["state"] == "running"
            await asyncio.sleep(1.2)  # past the visibility timeout and a reclaim period
            again = await b.take(LABEL, 2, 0.2)
            assert jobs[0].id in {d.job_id for d in again}, again
        finally:
            await b.close()
    asyncio.run(scenario())


def test_finished_jobs_are_counted_with_their_records_against_the_results_bound():
    """helper-49: thousands of small finished jobs were charged their ~100-byte results alone and
    kept 12 kB each (92 MiB for 7 598; max_finished_jobs let 100 000 hold 1.2 GB). Each is now
    counted with its record, and the oldest are forgotten past max_results_bytes."""
    from services.jobs.memory_broker import RECORD_BYTES

    async def scenario():
        b = MemoryBroker(QueueSettings(prefix="rec", max_results_bytes=10 * RECORD_BYTES + 4096,
                                       max_finished_jobs=100_000), "n1", 100)
        await b.start()
        ids = []
        for _ in range(30):
            j = job()
            ids.append(j.id)
            await b.submit(j, LABEL)
            d = await take_one(b)
            assert await b.finish(d, Outcome("succeeded", b"[]", "application/json", 200)) == "ok"
        assert len(b.finished) == 10 and b.results_bytes <= 10 * RECORD_BYTES + 4096
        assert await b.get(ids[0]) is None and (await b.get(ids[-1]))["state"] == "succeeded"
        await b.close()
    asyncio.run(scenario())

"""A finished job's body is not kept alive by the consumer that ran it (services.jobs.consumer).

The take loop bound the last batch it took to its locals while it waited for the next take:
with no new work, the bodies of up to max_in_flight jobs (20 MB each in the attack soak's
9j) stayed in memory for good after their jobs had succeeded (+136 MiB in the jobs service).
The lease-renewing loop did the same with the runs it had renewed, for a renew period."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import weakref

from services.jobs.broker import QueueUnavailable
from services.jobs.consumer import Consumer
from services.jobs.memory_broker import MemoryBroker
from services.jobs.metrics import JobsMetrics
from services.jobs.records import Delivery, NewJob
from services.jobs.settings import JobsSettings, QueueSettings, TargetSettings
from services.jobs.targets import Target


async def _service(delay_s: float = 0.0, drop_first: bool = False):
    """A local service that answers every job after ``delay_s`` (and /readyz); with
    ``drop_first``, it drops its first job without answering (it went away). Returns the
    server and the body lengths of the jobs it was sent."""
    calls = []

    async def handle(reader, writer):
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.startswith("content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith("post"):
                    calls.append(length)
                    if drop_first and len(calls) == 1:
                        writer.transport.abort()
                        return
                await asyncio.sleep(delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0), calls


@contextlib.asynccontextmanager
async def _consumer(url: str, max_in_flight: int, renew_period_s: float, up: bool = False):
    """(broker, consumer) for a target at ``url``, all closed after."""
    target = Target("svc", url, TargetSettings(), run_timeout_s=10, dry_run_timeout_s=5, label="m",
                    routes=["/api/v1/run"], max_in_flight=max_in_flight, up=up)
    broker = MemoryBroker(QueueSettings(prefix="t", retry_backoff_s=0), "n1", 100)
    await broker.start()
    consumer = Consumer(broker, target, JobsSettings(), JobsMetrics(), renew_period_s=renew_period_s)
    try:
        yield broker, consumer
    finally:
        await consumer.stop(0)
        await broker.close()
        await target.close()


def _job(k: int) -> NewJob:
    return NewJob(id=f"{k:032x}", service="svc", route="/api/v1/run", model="m",
                  body=b'{"x": "%s"}' % (b"a" * (1 << 20)), request_sha=str(k), idempotency_key=None,
                  created_at=time.time())


async def _until_succeeded(broker: MemoryBroker, ids: list[str]) -> list[str]:
    deadline = time.monotonic() + 20
    while True:
        states = [(await broker.get(i))["state"] for i in ids]
        if all(s == "succeeded" for s in states) or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.05)


def _without_collection(main):
    """asyncio.run(main()) with the cyclic collector off: what a cycle holds stays held."""
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(main())
    finally:
        gc.enable()


def _alive_bodies() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Delivery)  # type(): no proxy's __class__ is asked


def test_the_bodies_of_finished_jobs_are_not_held_by_the_consumer():
    # The jobs run 1.2 s, so leases are renewed (at 1 s) while they run; the check comes
    # before the next renewal.
    async def main():
        server, _calls = await _service(1.2)
        port = server.sockets[0].getsockname()[1]
        try:
            async with _consumer(f"http://127.0.0.1:{port}", 5, 1.0) as (broker, consumer):
                renewed = []
                real_renew = broker.renew

                async def renew(label, deliveries):
                    renewed.append(len(deliveries))
                    return await real_renew(label, deliveries)

                broker.renew = renew
                ids = [(await broker.submit(_job(k), "m")).id for k in range(5)]
                consumer.start()
                assert await _until_succeeded(broker, ids) == ["succeeded"] * 5
                await asyncio.sleep(0.2)  # the take loop is back waiting for work
                assert not consumer.running and broker.bodies_bytes == 0
                assert renewed and renewed[0] == 5  # the renewing loop has seen the runs
                return _alive_bodies()
        finally:
            server.close()

    assert asyncio.run(main()) == 0


def test_a_run_that_lost_its_service_frees_its_body_without_a_collection():
    """A failed call's exception, its task and the waiting frame made a cycle that held the
    job's body (and the answer read so far) until a full collection: minutes on an idle unit."""
    async def main():
        server, calls = await _service(drop_first=True)
        port = server.sockets[0].getsockname()[1]
        try:
            async with _consumer(f"http://127.0.0.1:{port}", 1, 30.0) as (broker, consumer):
                taken = []
                real_take = broker.take

                async def take(label, n, block_s):
                    got = await real_take(label, n, block_s)
                    taken.extend(weakref.ref(d) for d in got)
                    return got

                broker.take = take
                job_id = (await broker.submit(_job(0), "m")).id
                consumer.start()
                assert await _until_succeeded(broker, [job_id]) == ["succeeded"] and len(calls) == 2
                await asyncio.sleep(0.2)
                return [r() for r in taken if r() is not None]
        finally:
            server.close()

    assert _without_collection(main) == []


def test_a_failed_take_keeps_nothing_it_read_while_the_loop_backs_off():
    """The take loop slept its backoff inside the handler of the failure, whose context (the
    timeout a Redis take ran into) held the take's frame and what it had read: job bodies."""
    class Read:  # stands for the bodies a failed take had read
        pass

    async def main():
        async with _consumer("http://127.0.0.1:9", 1, 30.0, up=True) as (broker, consumer):
            read = []

            async def take(label, n, block_s):
                bodies = Read()
                read.append(weakref.ref(bodies))
                try:
                    raise TimeoutError("the queue did not answer")
                except TimeoutError:
                    raise QueueUnavailable("timeout") from None

            broker.take = take
            alive = []
            consumer.start()
            for _ in range(6):  # the backoff doubles from 0.1 s: most of this time is spent sleeping it
                await asyncio.sleep(0.13)
                alive.append(sum(r() is not None for r in read))
            return alive, len(read), consumer.loop_errors

    jobs_log = logging.getLogger("onecard.jobs")
    jobs_log.propagate = False  # pytest's capture keeps every record, and a record its exception
    try:
        alive, takes, errors = _without_collection(main)
    finally:
        jobs_log.propagate = True
    assert takes >= 2 and errors == takes and alive == [0] * 6

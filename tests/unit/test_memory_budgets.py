"""The service's memory budgets: where the limit comes from (cgroup v2, v1, an ancestor's, the
machine's RAM; fake trees here, the real cgroup in tests/integration/test_cost_cgroup.py),
how the budget is split, and the ledger of what requests hold."""

from __future__ import annotations

import threading

import pytest

from common import hostmemory as memory
from common.hostmemory import service_memory
from services.runtime.codecs.encoder_limits import working_bytes
from services.runtime.errors import ApiError
from services.runtime.pipeline.budgets import Charge, HeldMemory, plan_budgets
from services.runtime.pipeline.cost import RequestCost, ServiceCost

GIB = 2**30


def tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_the_cgroup_v2_limit_of_this_cgroup_or_an_ancestor_and_never_more_than_the_ram(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
                           "proc/meminfo": "MemTotal:       16000000 kB\n",
                           "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
                           "sys/fs/cgroup/kubepods/pod1/memory.max": str(8 * GIB) + "\n"})
    assert memory.cgroup_memory_limit(root) == 8 * GIB
    assert memory.memory_limit(root) == 8 * GIB
    (tmp_path / "sys/fs/cgroup/kubepods/pod1/memory.max").write_text(str(64 * GIB))
    assert memory.memory_limit(root) == 16000000 * 1024  # the RAM is the tighter one


def test_the_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "9:memory:/docker/abc\n8:cpu,cpuacct:/docker/abc\n",
                           "proc/meminfo": "MemTotal:       16000000 kB\n",
                           "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(3 * GIB),
                           "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"})
    assert memory.cgroup_memory_limit(root) == 3 * GIB
    (tmp_path / "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712")
    assert memory.cgroup_memory_limit(root) is None and memory.memory_limit(root) == 16000000 * 1024


def test_no_cgroup_files_and_no_meminfo_give_no_limit(tmp_path):
    assert memory.memory_limit(str(tmp_path)) is None


def test_where_the_service_budget_comes_from():
    assert service_memory(5 * GIB, None, {}) == (5 * GIB, "memory_budget_bytes")
    assert service_memory(None, None, {"ONECARD_MEMORY_BUDGET_BYTES": str(2 * GIB)}, limit=8 * GIB) == (
        2 * GIB, "the supervisor's plan")
    got, source = service_memory(None, None, {}, limit=8 * GIB)
    assert got == int(8 * GIB * 0.3) and "0.3 of the memory limit" in source
    assert service_memory(None, 0.5, {}, limit=8 * GIB)[0] == 4 * GIB


def test_the_split_of_a_budget_and_explicit_settings_win():
    b = plan_budgets(4 * GIB, GIB)
    assert b.batch_bytes == 3 * GIB // 2 and b.held_bytes == 3 * GIB - 3 * GIB // 2
    assert b.request_bytes == b.held_bytes // 2
    explicit = plan_budgets(4 * GIB, GIB, batch_bytes=GIB, request_bytes=GIB // 4)
    assert (explicit.batch_bytes, explicit.held_bytes, explicit.request_bytes) == (GIB, 2 * GIB, GIB // 4)
    gpu = plan_budgets(4 * GIB, GIB, gpu_batch_bytes=20 * GIB)
    assert gpu.batch_on_gpu and gpu.batch_bytes == 20 * GIB and gpu.held_bytes == 3 * GIB
    assert plan_budgets(GIB, 2 * GIB).held_bytes > 0  # a baseline over the budget still leaves a floor


def test_the_ledger_refuses_growth_that_others_leave_no_room_for_and_gives_it_back():
    ledger = HeldMemory(1000, retry_after_s=2)
    a, b = Charge(ledger), Charge(ledger)
    a.hold(600)
    with pytest.raises(ApiError) as err:
        b.hold(500, "the body")
    assert (err.value.status, err.value.code) == (503, "memory_busy") and err.value.headers["Retry-After"] == "2"
    assert ledger.used == 600 and ledger.refused == 1
    b.hold(400)
    a.account(900)   # an answer already made is counted, never refused
    assert ledger.used == 1300 and ledger.peak == 1300
    a.close()
    a.close()        # twice is once
    b.close()
    assert ledger.used == 0


def test_the_ledger_is_exact_under_threads():
    ledger = HeldMemory(10**12)

    def churn():
        for n in range(2000):
            c = Charge(ledger)
            c.hold(n)
            c.hold(n // 2)
            c.close()

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.used == 0


class _Backend:
    memory_per_pixel = 100.0

    def item_pixels(self, item):
        return 0

    def item_work(self, item):
        return 1.0


def test_a_request_cost_is_the_product_of_its_figures_not_each_figure_alone():
    """64 pictures each within max_pixels, in a request within max_body_bytes: held bytes are
    64 x 40 M x 3 = 7.7 GB, refused whatever each figure alone would allow."""
    service = ServiceCost(_Backend(), 8)
    service.budgets = plan_budgets(8 * GIB, 0)
    service.held = HeldMemory(service.budgets.held_bytes)
    cost = RequestCost(service, service.new_charge(), body_bytes=4_500_000)
    with pytest.raises(ApiError) as err:
        cost.check(items=64, item_pixels=1024 * 1024, input_pixels=64 * 40_000_000, output_pixels=64 * 1024 * 1024)
    assert (err.value.status, err.value.code) == (413, "too_costly") and "64 item(s)" in err.value.message
    assert service.held.used == 0
    small = RequestCost(service, service.new_charge())
    estimate = small.check(items=2, item_pixels=512 * 512, input_pixels=512 * 512, output_pixels=2 * 512 * 512)
    assert estimate.held_bytes == (3 * (512 * 512 + 2 * 512 * 512 + 2 * 512 * 512) + estimate.output_bytes
                                   + working_bytes(512 * 512, "png"))  # one answer encoded at a time
    assert service.held.used == estimate.held_bytes
    assert estimate.call_bytes == int(1.25 * 100 * 512 * 512)


@pytest.mark.parametrize("said, told", [({}, None), ({"output_bytes": 0}, 0), ({"output_bytes": 9000}, 9000),
                                        ({"output_pixels": 100}, 100 * 3 + 100 * 3 // 64 + 4096)])
def test_a_dry_run_tells_the_answer_s_size_only_where_the_hook_said_it(said, told):
    """Unsaid, a small JSON answer is counted in what the request holds, but the dry run says
    null: a job reserves result_reserve_bytes for its result, not that guess."""
    estimate = RequestCost(None, Charge(HeldMemory(2**30))).check(items=1, **said)
    assert estimate.public()["output_bytes"] == told and "output_stated" not in estimate.public()
    assert estimate.output_bytes == (4096 if told is None else told)


def test_a_request_that_does_not_fit_waits_its_turn_and_gets_the_room_first_come_first_served():
    import asyncio

    from services.runtime.pipeline.budgets import MemoryWait

    async def main():
        ledger = HeldMemory(1000)
        running = Charge(ledger)
        running.hold(800)
        big, small = Charge(ledger), Charge(ledger)
        with pytest.raises(MemoryWait) as wait:
            big.hold(600, "big", wait=True)
        assert wait.value.needed == 600
        order = []

        async def waiter(charge, n, name):
            await ledger.wait_for(charge, n, name, timeout=5)
            order.append(name)

        first = asyncio.ensure_future(waiter(big, 600, "big"))
        await asyncio.sleep(0.01)
        with pytest.raises(MemoryWait):
            small.hold(100, "small", wait=True)   # would fit, but the line is first come, first served
        second = asyncio.ensure_future(waiter(small, 100, "small"))
        await asyncio.sleep(0.01)
        assert order == [] and ledger.used == 800
        running.close()                           # the room comes back: the line is served in order
        await asyncio.gather(first, second)
        assert order == ["big", "small"] and big.bytes == 600 and small.bytes == 100 and ledger.used == 700
        late = Charge(ledger)
        with pytest.raises(ApiError) as err:      # not its turn before its deadline: 503
            await ledger.wait_for(late, 400, "late", timeout=0.05)
        assert (err.value.status, err.value.code) == (503, "memory_busy") and late.bytes == 0
        assert ledger.waited == 3 and ledger.refused == 1 and ledger.used == 700
        small.close()
        big.close()
        assert ledger.used == 0

    asyncio.run(main())


def test_a_waiter_whose_client_leaves_is_out_of_the_line_and_does_not_block_it():
    import asyncio

    async def main():
        ledger = HeldMemory(1000)
        holder = Charge(ledger)
        holder.hold(900)
        gone, next_one = Charge(ledger), Charge(ledger)
        leaving = asyncio.ensure_future(ledger.wait_for(gone, 500, "gone", timeout=5))
        await asyncio.sleep(0.01)
        staying = asyncio.ensure_future(ledger.wait_for(next_one, 50, "next", timeout=5))
        await asyncio.sleep(0.01)
        leaving.cancel()                          # the client left while waiting
        await asyncio.gather(leaving, return_exceptions=True)
        await asyncio.wait_for(staying, 1)        # 50 fit beside the 900: served once the line moves
        assert gone.bytes == 0 and next_one.bytes == 50 and ledger.used == 950

    asyncio.run(main())


def test_a_hook_run_again_after_waiting_for_its_body_copies_keeps_the_room_it_waited_for():
    """A hook that states its cost, then parses its body (charged its copies): when the copies
    wait their turn, the pipeline grants them and runs the hook again. Its cost check then
    counts the copies: the holding neither shrinks back to the body nor waits again."""
    import asyncio

    from services.runtime.pipeline.budgets import MemoryWait

    ledger = HeldMemory(1000)
    running = Charge(ledger)
    running.hold(800)
    charge = Charge(ledger)
    cost = RequestCost(None, charge, body_bytes=100)

    def hook() -> None:
        cost.check(items=1, output_bytes=0)
        cost.hold_body_copies(250)

    with pytest.raises(MemoryWait) as wait:
        hook()
    assert charge.bytes == 100 and wait.value.needed == 350
    running.close()
    asyncio.run(ledger.wait_for(charge, wait.value.needed, "copies", timeout=5))
    assert charge.bytes == 350

    async def run_again_while_another_waits() -> None:
        queued = Charge(ledger)                 # fits only if this one shrinks
        waiting = asyncio.ensure_future(ledger.wait_for(queued, 700, "queued", timeout=5))
        await asyncio.sleep(0.01)
        try:
            hook()                              # run again: no shrink, no second wait
            assert charge.bytes == 350 and cost.estimate.held_bytes == 350 and queued.bytes == 0
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(run_again_while_another_waits())

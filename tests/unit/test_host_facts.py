"""What the supervisor reads of the host, against fakes (tests/fakes/): the CPU quota and
throttling from cgroup trees, NVML's GPU facts, and the sampler's CPU accounting. Their
integration twins: tests/integration/test_gpu_resources.py (NVML absent, the real
cgroup's cpu.stat)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from supervisor.policy.plan import CpuQuota
from supervisor.system.cpu_cgroup import CpuStat, ThrottleWindow, read_cpu_quota, read_cpu_stat
from supervisor.system.nvml import GpuFacts
from tests.fakes.cgroups import cpu_stat, v1_cpu_tree, v2_tree
from tests.fakes.nvml import FakeNvml


def test_v2_fractional_quota(tmp_path):
    root = v2_tree(tmp_path, "150000 100000")
    q = read_cpu_quota(root, proc_self_cgroup="0::/\n", affinity=64)
    assert q.cpus == 1.5 and q.source == "cgroup2" and q.quota == 1.5 and q.whole_cpus == 1


def test_v2_unlimited_falls_back_to_affinity(tmp_path):
    root = v2_tree(tmp_path, "max 100000")
    q = read_cpu_quota(root, proc_self_cgroup="0::/\n", affinity=8)
    assert q.cpus == 8 and q.quota is None


def test_v2_nested_cgroup_takes_the_tightest_ancestor(tmp_path):
    root = v2_tree(tmp_path, "400000 100000", rel="kubepods/pod1")
    (root / "kubepods" / "cpu.max").write_text("200000 100000\n")
    q = read_cpu_quota(root, proc_self_cgroup="0::/kubepods/pod1\n", affinity=16)
    assert q.cpus == 2.0
    assert q.cgroup_dir == str(root / "kubepods" / "pod1")


def test_v1_quota(tmp_path):
    q = read_cpu_quota(v1_cpu_tree(tmp_path, "cpu,cpuacct", 350000), proc_self_cgroup="", affinity=32)
    assert q.cpus == 3.5 and q.source == "cgroup1" and q.whole_cpus == 3


def test_v1_unlimited(tmp_path):
    q = read_cpu_quota(v1_cpu_tree(tmp_path, "cpu", -1), proc_self_cgroup="", affinity=4)
    assert q.cpus == 4 and q.quota is None


def test_no_cgroup_at_all(tmp_path):
    q = read_cpu_quota(tmp_path / "absent", proc_self_cgroup="", affinity=3)
    assert q == CpuQuota(3.0, "affinity", 3, None, None)


def test_affinity_below_quota_wins(tmp_path):
    root = v2_tree(tmp_path, "800000 100000")
    assert read_cpu_quota(root, proc_self_cgroup="0::/\n", affinity=2).cpus == 2


def test_cpu_stat_v2_and_v1(tmp_path):
    v2 = cpu_stat(tmp_path / "v2", "usage_usec 5\nnr_periods 200\nnr_throttled 50\nthrottled_usec 2500000\n")
    assert read_cpu_stat(CpuQuota(1.5, "cgroup2", 8, 1.5, str(v2))) == CpuStat(200, 50, 2.5)
    v1 = cpu_stat(tmp_path / "v1", "nr_periods 10\nnr_throttled 3\nthrottled_time 1500000000\n")
    assert read_cpu_stat(CpuQuota(2, "cgroup1", 8, 2, str(v1))) == CpuStat(10, 3, 1.5)
    assert read_cpu_stat(CpuQuota(8, "affinity", 8, None, None)) is None


def test_throttled_share_over_the_last_minute():
    now = [0.0]
    stats = iter([CpuStat(0, 0, 0.0), CpuStat(300, 30, 1.0), CpuStat(600, 180, 4.0), CpuStat(900, 180, 4.0)])
    w = ThrottleWindow(CpuQuota(1, "cgroup2", 4, 1, "/x"), clock=lambda: now[0], reader=lambda q: next(stats))
    w.sample()
    now[0] = 30.0
    w.sample()
    now[0] = 60.0
    s = w.summary()
    assert s["throttled_share_1m"] == pytest.approx(180 / 600) and s["throttled_s_1m"] == 4.0
    now[0] = 125.0
    s = w.summary()  # the first two samples are out of the window now
    assert s["window_s"] <= 65 and s["throttled_share_1m"] == pytest.approx(0.0)


def test_nvml_facts_and_per_service_memory_by_pid():
    facts = GpuFacts("0", nvml=FakeNvml(procs=[(100, 2 * 2**30), (101, 2**30), (999, 5 * 2**30)]))
    got = facts.read({"detect": {100, 101}, "img2img": {200}})
    assert got["available"] and got["name"] == "NVIDIA H100 80GB HBM3"
    assert got["memory_total_bytes"] == 80 * 2**30 and got["utilization_percent"] == 57
    assert got["per_service_bytes"] == {"detect": 3 * 2**30}  # img2img's PID is not NVML's (container)


def test_the_budget_card_is_the_visible_one_not_device_0():
    assert GpuFacts("1", nvml=FakeNvml()).total_bytes() == 16 * 2**30
    assert GpuFacts("0", nvml=FakeNvml()).total_bytes() == 80 * 2**30
    assert GpuFacts("1,0", nvml=FakeNvml()).total_bytes() == 16 * 2**30  # the first visible card


def test_no_nvml_is_a_reason_not_a_traceback():
    got = GpuFacts("0", nvml=FakeNvml(fail_init=True)).read({"a": {1}})
    assert got == {"available": False, "reason": "NVML unavailable: OSError: NVML Shared Library Not Found"}


def test_report_falls_back_to_what_the_service_reports():
    from supervisor.driver.child import ChildProcess
    from supervisor.driver.report import _gpu_memory
    plan = SimpleNamespace(name="img2img")
    child = ChildProcess(plan)  # type: ignore[arg-type]
    assert _gpu_memory(child, {"per_service_bytes": {}}) == (None, None)
    child.stats = {"gpu_memory_bytes": 1234}
    assert _gpu_memory(child, {"per_service_bytes": {}}) == (1234, "service")
    assert _gpu_memory(child, {"per_service_bytes": {"img2img": 99}}) == (99, "nvml")


def test_cpu_account_never_goes_back():
    from supervisor.driver.sampler import CpuAccount
    acc = CpuAccount()
    root, worker, helper = (10, 1.0), (11, 1.0), (12, 1.0)
    assert acc.update({root: 1.0, worker: 2.0}, {root: 1, worker: 10}) == 3.0
    # the worker exits and its parent (in the tree) reaps it: its time moves to the parent's cutime
    assert acc.update({root: 3.0}, {root: 1}) == 3.0
    # a helper re-parented away (its parent left the tree) vanishes: what it used stays counted
    assert acc.update({root: 3.0, helper: 0.5}, {root: 1, helper: 999}) == 3.5
    assert acc.update({root: 3.0}, {root: 1}) == 3.5
    # a reading that goes down (pid reuse, a racing /proc read) never lowers the total
    assert acc.update({root: 2.0}, {root: 1}) == 3.5
    assert acc.update({root: 4.0}, {root: 1}) == 4.5
    # a child that vanishes while its parent stays, but whose time the parent never shows
    # (it was not the parent that reaped it): the total still does not drop
    child = (13, 2.0)
    assert acc.update({root: 4.0, child: 1.0}, {root: 1, child: 10}) == 5.5
    assert acc.update({root: 4.0}, {root: 1}) == 5.5


def test_sampler_percent_is_never_negative():
    from supervisor.driver.sampler import Sampler
    s = Sampler(period_s=1)
    assert s._percent("k", 5.0, 0.0) is None
    assert s._percent("k", 4.0, 1.0) == 0.0

"""NVML facts against a fake NVML, cpu.stat against fake cgroup files, budgets and MPS in the plan.

Their integration twins: tests/integration/test_gpu_resources.py (real NVML absence,
the real cgroup's cpu.stat, the MPS stand-in binary)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from supervisor.config import Config, ConfigError, load_config
from supervisor.cpuquota import CpuQuota, CpuStat, ThrottleWindow, read_cpu_stat
from supervisor.gpu import GpuFacts
from supervisor.plan import build_plan


class FakeNvml:
    def __init__(self, procs=(), fail_init=False):
        self.procs = procs
        self.fail_init = fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"gpu{i}"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=30 * 2**30, total=(80 if h != "gpu1" else 16) * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=57)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []


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
    from supervisor.child import ChildProcess
    from supervisor.report import _gpu_memory
    plan = SimpleNamespace(name="img2img")
    child = ChildProcess(plan)  # type: ignore[arg-type]
    assert _gpu_memory(child, {"per_service_bytes": {}}) == (None, None)
    child.stats = {"gpu_memory_bytes": 1234}
    assert _gpu_memory(child, {"per_service_bytes": {}}) == (1234, "service")
    assert _gpu_memory(child, {"per_service_bytes": {"img2img": 99}}) == (99, "nvml")


def test_cpu_stat_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 5\nnr_periods 200\nnr_throttled 50\nthrottled_usec 2500000\n")
    assert read_cpu_stat(CpuQuota(1.5, "cgroup2", 8, 1.5, str(v2))) == CpuStat(200, 50, 2.5)
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.stat").write_text("nr_periods 10\nnr_throttled 3\nthrottled_time 1500000000\n")
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


def _cfg(**services):
    return Config.model_validate({"supervisor": {"control_socket": "/run/onecard/c.sock"},
                                  "services": {n: {"app": "m:f", "port": 9000 + i, **v}
                                               for i, (n, v) in enumerate(services.items())}})


def test_budgets_over_the_card_are_a_config_error(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[services.a]\napp = "m:f"\nport = 9000\ngpu_memory_fraction = 0.6\n'
                 '[services.b]\napp = "m:f"\nport = 9001\ngpu_memory_fraction = 0.5\n')
    with pytest.raises(ConfigError, match=r"budgets add up to 1.10 of the card \(a 0.60, b 0.50\)"):
        load_config(p, environ={})
    p.write_text('[services.a]\napp = "m:f"\nport = 9000\ngpu_memory_fraction = 0.6\n'
                 '[services.b]\napp = "m:f"\nport = 9001\ngpu_memory_bytes = 4294967296\n')
    load_config(p, environ={})  # bytes cannot be judged without the card
    with pytest.raises(ConfigError, match="budgets add up to 1.10"):
        load_config(p, environ={}, gpu_total_bytes=int(4294967296 / 0.5))


def test_plan_passes_budgets_and_mps_to_children():
    cfg = _cfg(a={"gpu_memory_fraction": 0.25, "mps_thread_percentage": 40}, b={"gpu_memory_bytes": 1000})
    cfg.gpu.mps = True
    plan = build_plan(cfg, CpuQuota(4, "affinity", 4, None, None), {})
    a, b = plan.services
    assert plan.mps_dir == "/run/onecard/c.sock.d/mps"  # inside the supervisor's private run dir
    assert a.env["ONECARD_GPU_MEMORY_FRACTION"] == "0.25" and b.env["ONECARD_GPU_MEMORY_BYTES"] == "1000"
    assert a.env["CUDA_MPS_PIPE_DIRECTORY"] == b.env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/onecard/c.sock.d/mps/pipe"
    assert a.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in b.env


def test_service_side_budget_from_the_plan(monkeypatch):
    from services.runtime.device.gpu import budget_bytes
    monkeypatch.delenv("ONECARD_GPU_MEMORY_BYTES", raising=False)
    monkeypatch.setenv("ONECARD_GPU_MEMORY_FRACTION", "0.25")
    assert budget_bytes(total=8000) == 2000
    monkeypatch.setenv("ONECARD_GPU_MEMORY_BYTES", "1234")
    assert budget_bytes(total=8000) == 1234


def test_cpu_account_never_goes_back():
    from supervisor.sampler import CpuAccount
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
    from supervisor.sampler import Sampler
    s = Sampler(period_s=1)
    assert s._percent("k", 5.0, 0.0) is None
    assert s._percent("k", 4.0, 1.0) == 0.0

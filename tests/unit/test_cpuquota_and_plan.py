from __future__ import annotations

import json

import pytest

from supervisor.config.errors import ConfigError
from supervisor.config.schema import Config
from supervisor.policy.plan import CpuQuota
from supervisor.system.cpu_cgroup import read_cpu_quota
from supervisor.policy.plan import build_plan, plan_threads


def v2_tree(tmp_path, cpu_max: str | None, rel: str = ""):
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    leaf = root / rel if rel else root
    leaf.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (leaf / "cpu.max").write_text(cpu_max + "\n")
    return root


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
    d = tmp_path / "cg1" / "cpu,cpuacct"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("350000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    q = read_cpu_quota(tmp_path / "cg1", proc_self_cgroup="", affinity=32)
    assert q.cpus == 3.5 and q.source == "cgroup1" and q.whole_cpus == 3


def test_v1_unlimited(tmp_path):
    d = tmp_path / "cg1" / "cpu"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    q = read_cpu_quota(tmp_path / "cg1", proc_self_cgroup="", affinity=4)
    assert q.cpus == 4 and q.quota is None


def test_no_cgroup_at_all(tmp_path):
    q = read_cpu_quota(tmp_path / "absent", proc_self_cgroup="", affinity=3)
    assert q == CpuQuota(3.0, "affinity", 3, None, None)


def test_affinity_below_quota_wins(tmp_path):
    root = v2_tree(tmp_path, "800000 100000")
    assert read_cpu_quota(root, proc_self_cgroup="0::/\n", affinity=2).cpus == 2


def _config(**threads):
    return Config.model_validate({"services": {
        n: {"app": "m:f", "port": 9000 + i, "threads": t} for i, (n, t) in enumerate(threads.items())}})


def quota(cpus: float) -> CpuQuota:
    return CpuQuota(cpus, "cgroup2", 64, cpus, None)


def test_auto_threads_share_the_quota_not_the_host():
    threads, warnings = plan_threads(_config(a="auto", b="auto"), quota(7))
    assert threads == {"a": 3, "b": 3} and not warnings


def test_fixed_then_auto():
    threads, _ = plan_threads(_config(a=4, b="auto"), quota(6))
    assert threads == {"a": 4, "b": 2}


def test_impossible_thread_plan_is_an_error():
    with pytest.raises(ConfigError, match=r"services.a.threads: 8 threads but only 1.5 CPUs"):
        plan_threads(_config(a=8), quota(1.5))


def test_oversubscription_warns():
    threads, warnings = plan_threads(_config(a=1, b=1, c="auto"), quota(2))
    assert threads == {"a": 1, "b": 1, "c": 1}
    assert warnings and "want 3 threads but only 2 CPUs" in warnings[0]


def test_plan_environment():
    plan = build_plan(_config(a=2), quota(4), {"PATH": "/bin", "ONECARD_SERVICES__A__PORT": "1"})
    sp = plan.services[0]
    assert sp.env["PATH"] == "/bin"
    assert "ONECARD_SERVICES__A__PORT" not in sp.env  # the supervisor's overrides do not leak
    assert sp.env["OMP_NUM_THREADS"] == sp.env["ONECARD_SERVICE_THREADS"] == "2"
    assert sp.env["ONECARD_SERVICE_APP"] == "m:f"


def test_every_service_learns_where_the_units_app_services_listen():
    config = Config.model_validate({"services": {
        "a": {"app": "m:f", "port": 9000, "host": "0.0.0.0"},
        "b": {"app": "m:f", "port": 9001, "host": "::1"},
        "c": {"app": "m:f", "port": 9002, "enabled": False},
        "d": {"command": ["sleep", "1"], "port": 9003}}})
    plan = build_plan(config, quota(4), {})
    for sp in plan.services:
        assert json.loads(sp.env["ONECARD_UNIT_SERVICES"]) == {
            "a": {"url": "http://127.0.0.1:9000"}, "b": {"url": "http://[::1]:9001"}}


def test_each_service_gets_a_host_memory_budget_from_the_units_limit():
    from supervisor.policy.plan import plan_memory
    gib = 2**30
    cfg = Config.model_validate({"services": {
        "big": {"app": "m:f", "port": 9001, "memory_fraction": 0.5},
        "fixed": {"app": "m:f", "port": 9002, "memory_bytes": gib},
        "a": {"app": "m:f", "port": 9003}, "b": {"app": "m:f", "port": 9004}}})
    budgets = plan_memory(cfg, 8 * gib)
    assert budgets["big"] == 4 * gib and budgets["fixed"] == gib
    assert budgets["a"] == budgets["b"] == (int(8 * gib * 0.9) - 5 * gib) // 2  # an equal share of what is left
    assert plan_memory(cfg, None) == {"fixed": gib}  # no limit known: only what was asked in bytes
    plan = build_plan(cfg, quota(4), {}, memory_limit=8 * gib)
    assert {p.name: p.env.get("ONECARD_MEMORY_BUDGET_BYTES") for p in plan.services} == {
        n: str(v) for n, v in budgets.items()}


def test_memory_shares_over_the_units_are_a_config_problem():
    from supervisor.config.validation import semantic_problems
    cfg = Config.model_validate({"services": {
        "a": {"app": "m:f", "port": 9001, "memory_fraction": 0.6},
        "b": {"app": "m:f", "port": 9002, "memory_fraction": 0.5}}})
    assert any("memory_fraction: budgets add up to 1.10" in p for p in semantic_problems(cfg))
    with pytest.raises(ValueError):
        Config.model_validate({"services": {"a": {"app": "m:f", "port": 9001, "memory_fraction": 0.5,
                                                  "memory_bytes": 10}}})

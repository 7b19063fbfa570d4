"""The plan (supervisor/policy/plan.py): threads from the CPU quota, each service's
environment, host memory and GPU budgets, MPS; and the config rules about budgets."""

from __future__ import annotations

import json

import pytest

from supervisor.config.errors import ConfigError
from supervisor.config.loading import load_config
from supervisor.config.schema import Config
from supervisor.policy.plan import CpuQuota, build_plan, plan_threads


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

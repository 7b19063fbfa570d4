"""A supervisor driven by a script: the scripted OS (os_layer.py), the manual clock
(clock.py) and scripted probe answers; no real process.

Used by the driver's tests (tests/unit/test_driver_*.py). Each faked behaviour has its
integration twin against real processes (tests/integration/test_lifecycle.py,
test_containment.py, test_signals.py, test_control.py).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json

from supervisor.config.schema import Config
from supervisor.driver.child_probe import ProbeResult
from supervisor.driver.logs import LogSink
from supervisor.driver.sampler import Sampler
from supervisor.driver.supervisor import Supervisor
from supervisor.policy.plan import CpuQuota, build_plan
from tests.fakes.clock import ManualClock, count_thread_work, settle
from tests.fakes.os_layer import ScriptedOs


class NullSampler(Sampler):
    def start(self):
        pass


class Script:
    """Probe answers per (service, path): a status code, "foreign", a ProbeResult, or a
    function of (call number) returning one of those (or awaitable)."""

    def __init__(self, fake: ScriptedOs):
        self.fake = fake
        self.answers: dict[tuple[str, str], object] = {}
        self.ports: dict[int, str] = {}
        self.calls: dict[tuple[str, str], int] = {}

    def set(self, name, path, answer):
        self.answers[(name, path)] = answer

    async def __call__(self, target, path, timeout, max_body=0):
        name = self.ports[target.port]
        n = self.calls[(name, path)] = self.calls.get((name, path), 0) + 1
        answer = self.answers.get((name, path), 200)
        if callable(answer):
            answer = answer(n)
            if inspect.isawaitable(answer):
                answer = await answer
        if answer == "foreign":
            return ProbeResult(200, b"{}", instance="someone-else")
        if isinstance(answer, int):
            token = self.fake.tokens.get(target.port, "")
            return ProbeResult(answer, json.dumps({"instance": token}).encode(), instance=token)
        return answer


def make(tmp_path, names=("a", "b"), stubborn=(), port_problem=None, gpu=None, **sup):
    cfg = Config.model_validate({
        "supervisor": {"grace_s": 2.0, "health_port": 0, "control_socket": str(tmp_path / "s" / "c.sock"),
                       "liveness_period_s": 1.0, "readiness_period_s": 0.1, "startup_timeout_s": 30, **sup},
        "gpu": gpu or {},
        "services": {n: {"app": "m:f", "port": 9000 + i, "threads": 1} for i, n in enumerate(names)},
    })
    plan = build_plan(cfg, CpuQuota(4, "affinity", 4, None, None), {})
    fake = ScriptedOs(stubborn)
    script = Script(fake)
    script.ports = {9000 + i: n for i, n in enumerate(names)}
    clock = ManualClock()
    out = io.BytesIO()
    s = Supervisor(cfg.supervisor, cfg.gpu, plan, system=fake, clock=clock, log=LogSink("text", out), prober=script,
                   sampler=NullSampler(), port_check=port_problem or (lambda host, port: None))
    fake.sup = s
    return s, fake, clock, script, out


def history(s, clock, steps):
    """Run the supervisor through steps: numbers advance the clock, callables act."""
    async def main():
        count_thread_work(asyncio.get_running_loop())
        task = asyncio.create_task(s.run())
        await settle()
        for step in steps:
            if isinstance(step, (int, float)):
                await clock.advance(step)
            else:
                step()
                await settle()
            if task.done():
                break
        for _ in range(200):  # let the stop play out: grace and the rest
            if task.done():
                break
            await clock.advance(0.5)
        return await asyncio.wait_for(task, 5)
    return asyncio.run(main())


def text(out) -> str:
    return out.getvalue().decode()

"""A supervisor driven by a script: a scripted OS (process table, signals, reaping, what each
service started), a manual clock and scripted probe answers; no real process.

Used by test_policy.py and test_containment_rules.py. Each faked behaviour has its
integration twin against real processes (tests/integration/test_lifecycle.py,
test_containment.py, test_signals.py, test_control.py).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import io
import itertools
import json
import os
import signal

from supervisor.config import Config
from supervisor.containment import Leftover
from supervisor.cpuquota import CpuQuota
from supervisor.logs import LogSink
from supervisor.oslayer import Spawned
from supervisor.plan import build_plan
from supervisor.probe import ProbeResult
from supervisor.sampler import Sampler
from supervisor.unit import Supervisor


class ManualClock:
    """Moves only when told; timers fire in order as it moves."""

    def __init__(self):
        self.t = 0.0
        self._timers: list = []
        self._seq = itertools.count()

    def now(self):
        return self.t

    def call_later(self, delay, fn):
        handle = _Handle()
        heapq.heappush(self._timers, (self.t + max(0.0, delay), next(self._seq), fn, handle))
        return handle

    async def sleep(self, delay):
        fut = asyncio.get_running_loop().create_future()
        self.call_later(delay, lambda: fut.done() or fut.set_result(None))
        await fut

    async def advance(self, dt):
        target = self.t + dt
        while self._timers and self._timers[0][0] <= target:
            due, _, fn, handle = heapq.heappop(self._timers)
            self.t = due
            if not handle.cancelled:
                fn()
            await settle()
        self.t = target
        await settle()


class _Handle:
    cancelled = False

    def cancel(self):
        self.cancelled = True


async def settle(rounds: int = 6):
    for _ in range(rounds):
        await asyncio.sleep(0.002)


class FakeContainment:
    """What each service started beside its main process (`ScriptedOs.descendants`):
    SIGTERM ends those not in `stubborn_descendants`, SIGKILL those not `unkillable`."""

    kind = "fake"

    def __init__(self, fake: "ScriptedOs"):
        self.fake = fake
        self.released = False

    def describe(self):
        return "fake containment"

    def join_path(self, name):
        return f"/fake/{name}/cgroup.procs"

    def members(self, name, root):
        return set(self.fake.descendants.get(name, ()))

    def send(self, name, root, sig, skip_group=None):
        self.fake.member_signals.append((name, sig))
        if sig == signal.SIGTERM:
            self.fake.descendants[name] = {p for p in self.fake.descendants.get(name, ())
                                           if p in self.fake.stubborn_descendants}
        return set()

    def kill(self, name, root):
        self.fake.member_signals.append((name, signal.SIGKILL))
        self.fake.descendants[name] = {p for p in self.fake.descendants.get(name, ()) if p in self.fake.unkillable}
        return set(self.fake.descendants[name])

    def release(self):
        self.released = True

    def spec(self):
        return {}


class ScriptedOs:
    """A process table: children die when told; `stubborn` ones ignore SIGTERM."""

    def __init__(self, stubborn=()):
        self.next_pid = 1000
        self.names: dict[int, str] = {}
        self.by_name: dict[str, int] = {}
        self.tokens: dict[int, str] = {}   # port -> instance token of the spawn
        self.stubborn = set(stubborn)
        self.exits: list[tuple[int, int]] = []
        self.signals: list[tuple[str, int]] = []     # every group signal sent
        self.delivered: list[tuple[str, int]] = []   # those that reached a live child
        self.write_ends: dict[int, int] = {}
        self.spawned: list[str] = []
        self.joins: dict[str, str | None] = {}       # service -> the cgroup it joined
        self.envs: dict[str, dict] = {}
        self.fail_spawn: set[str] = set()
        self.descendants: dict[str, set[int]] = {}   # what each service started, beside its main
        self.stubborn_descendants: set[int] = set()
        self.unkillable: set[int] = set()
        self.member_signals: list[tuple[str, int]] = []
        self.left_behind: list[Leftover] = []        # what an earlier run left (found at start)
        self.ended: list[int] = []
        self.orphans_alive: set[int] = set()         # adopted orphans still running
        self.held: list[str] = []                    # "release"/"hold" of the stop signals, in order
        self.containment_obj = FakeContainment(self)
        self.sup: Supervisor | None = None

    def getpid(self):
        return 1

    def become_subreaper(self):
        return True

    def raise_open_files_limit(self):
        pass

    def release_signals(self, sigs):
        self.held.append("release")

    def hold_signals(self, sigs):
        self.held.append("hold")

    def containment(self, marker, names, mode):
        return self.containment_obj

    def leftovers(self, marker):
        return list(self.left_behind), []

    def end_leftovers(self, marker, found, dirs):
        self.ended += [x.pid for x in found]
        self.left_behind = []
        return set()

    def own_children(self):
        return set(self.orphans_alive) | set(self.write_ends)

    def start_sentinel(self, spec):
        return None, None

    def write(self, fd, data):
        pass

    def spawn(self, argv, env, stdin_data=None, join=None):
        name = env["ONECARD_SERVICE_NAME"]
        if name in self.fail_spawn:
            raise FileNotFoundError(2, "No such file or directory")
        self.next_pid += 1
        pid = self.next_pid
        self.names[pid], self.by_name[name] = name, pid
        self.tokens[int(env["ONECARD_SERVICE_PORT"])] = env["ONECARD_INSTANCE_TOKEN"]
        self.spawned.append(name)
        self.joins[name] = join
        self.envs[name] = env
        r, w = os.pipe()
        os.write(w, f"hello from {name}\n".encode())
        self.write_ends[pid] = w
        return Spawned(pid, r)

    def die(self, name_or_pid, status):
        pid = self.by_name.get(name_or_pid, name_or_pid)
        self.exits.append((pid, status))
        if pid in self.write_ends:
            os.close(self.write_ends.pop(pid))
        self.sup.handle_sigchld()

    def kill_group(self, pgid, sig):
        name = self.names[pgid]
        self.signals.append((name, sig))
        alive = pgid in self.write_ends
        if alive:
            self.delivered.append((name, sig))
        if alive and (sig == signal.SIGKILL or (sig == signal.SIGTERM and name not in self.stubborn)):
            status = sig if sig == signal.SIGKILL else 0  # raw wait status: killed by N, or exit 0
            asyncio.get_running_loop().call_soon(self.die, pgid, status)
        return alive

    def kill(self, pid, sig):
        if pid in self.orphans_alive:
            if sig == signal.SIGKILL and pid not in self.unkillable:
                self.orphans_alive.discard(pid)
            return True
        return self.kill_group(pid, sig)

    def reap(self):
        out, self.exits = self.exits, []
        return out

    def close(self, fd):
        pass


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


def make(tmp_path, names=("a", "b"), stubborn=(), port_problem=None, **sup):
    cfg = Config.model_validate({
        "supervisor": {"grace_s": 2.0, "health_port": 0, "control_socket": str(tmp_path / "s" / "c.sock"),
                       "liveness_period_s": 1.0, "readiness_period_s": 0.1, "startup_timeout_s": 30, **sup},
        "services": {n: {"app": "m:f", "port": 9000 + i, "threads": 1} for i, n in enumerate(names)},
    })
    plan = build_plan(cfg, CpuQuota(4, "affinity", 4, None, None), {})
    fake = ScriptedOs(stubborn)
    script = Script(fake)
    script.ports = {9000 + i: n for i, n in enumerate(names)}
    clock = ManualClock()
    out = io.BytesIO()
    s = Supervisor(cfg, plan, os_layer=fake, clock=clock, log=LogSink("text", out), prober=script,
                   sampler=NullSampler(), port_check=port_problem or (lambda host, port: None))
    fake.sup = s
    return s, fake, clock, script, out


def history(s, clock, steps):
    """Run the supervisor through steps: numbers advance the clock, callables act."""
    async def main():
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

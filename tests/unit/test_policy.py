"""The supervisor's exit rules replayed against a scripted OS: no real process here.

Each faked behaviour (reaping, group signals, orphans) has its integration twin in
tests/integration/test_lifecycle.py against real processes.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal

from supervisor.config import Config
from supervisor.cpuquota import CpuQuota
from supervisor.logs import LogSink
from supervisor.oslayer import Spawned
from supervisor.plan import build_plan
from supervisor.probe import ProbeResult
from supervisor.unit import Supervisor


class ScriptedOs:
    """Children that die when told to; `stubborn` ones ignore SIGTERM."""

    def __init__(self, stubborn=()):
        self.next_pid = 1000
        self.names: dict[int, str] = {}
        self.by_name: dict[str, int] = {}
        self.stubborn = set(stubborn)
        self.exits: list[tuple[int, int]] = []
        self.signals: list[tuple[str, int]] = []
        self.write_ends: dict[int, int] = {}
        self.sup: Supervisor | None = None
        self.t = 0.0

    def monotonic(self):
        return self.t

    def become_subreaper(self):
        return True

    def spawn(self, argv, env):
        self.next_pid += 1
        pid = self.next_pid
        name = env["ONECARD_SERVICE_NAME"]
        self.names[pid], self.by_name[name] = name, pid
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
        if alive and (sig == signal.SIGKILL or (sig == signal.SIGTERM and name not in self.stubborn)):
            status = sig if sig == signal.SIGKILL else 0  # raw wait status: killed by N, or exit 0
            asyncio.get_running_loop().call_soon(self.die, pgid, status)
        return alive

    def reap(self):
        out, self.exits = self.exits, []
        return out

    def close(self, fd):
        pass


def make(tmp_path, names=("a", "b"), stubborn=(), prober=None, **sup):
    cfg = Config.model_validate({
        "supervisor": {"grace_s": 0.2, "health_port": 0, "control_socket": str(tmp_path / "s" / "c.sock"),
                       "liveness_period_s": 0.01, "readiness_period_s": 0.01, **sup},
        "services": {n: {"app": "m:f", "port": 9000 + i, "threads": 1} for i, n in enumerate(names)},
    })
    plan = build_plan(cfg, CpuQuota(4, "affinity", 4, None, None), {})
    fake = ScriptedOs(stubborn)

    async def ready(host, port, path, timeout):
        return ProbeResult(200, b"{}")

    out = io.BytesIO()
    s = Supervisor(cfg, plan, os_layer=fake, log=LogSink("text", out), prober=prober or ready)
    fake.sup = s
    return s, fake, out


def run_with(s, script):
    async def main():
        task = asyncio.create_task(s.run())
        await asyncio.sleep(0.05)
        script()
        return await asyncio.wait_for(task, 5)
    return asyncio.run(main())


def test_child_exit_terminates_the_others_and_returns_its_code(tmp_path):
    s, fake, out = make(tmp_path)
    code = run_with(s, lambda: fake.die("a", 5 << 8))
    assert code == 5
    assert ("b", signal.SIGTERM) in fake.signals
    assert fake.signals.index(("b", signal.SIGTERM)) < len(fake.signals)
    assert b"a: exited with code 5; stopping every service" in out.getvalue()
    assert b"a        | hello from a" in out.getvalue()


def test_signal_death_is_128_plus_n(tmp_path):
    s, fake, _ = make(tmp_path)
    assert run_with(s, lambda: fake.die("b", signal.SIGSEGV)) == 128 + signal.SIGSEGV


def test_orphan_is_reaped_not_mistaken_for_a_child(tmp_path):
    s, fake, _ = make(tmp_path)

    def script():
        fake.exits.append((4242, 0))  # not one of ours
        s.handle_sigchld()
        asyncio.get_running_loop().call_later(0.05, s.handle_sigterm)

    assert run_with(s, script) == 0
    assert s.orphans_reaped == 1
    assert s.stop_reason == "SIGTERM received"


def test_sigterm_drains_everyone_and_exits_0(tmp_path):
    s, fake, _ = make(tmp_path)
    assert run_with(s, s.handle_sigterm) == 0
    assert {n for n, sig in fake.signals if sig == signal.SIGTERM} == {"a", "b"}
    assert not any(sig == signal.SIGKILL for n, sig in fake.signals[:2])


def test_stubborn_child_gets_sigkill_after_grace(tmp_path):
    s, fake, out = make(tmp_path, stubborn={"b"})
    assert run_with(s, s.handle_sigterm) == 0
    assert ("b", signal.SIGKILL) in fake.signals
    assert b"b: still running 0.2 s after SIGTERM; SIGKILL" in out.getvalue()
    assert s.children[1].killed


def test_second_sigint_kills_at_once(tmp_path):
    s, fake, _ = make(tmp_path, stubborn={"a", "b"}, grace_s=60)

    def script():
        s.handle_sigint()
        asyncio.get_running_loop().call_later(0.05, s.handle_sigint)

    assert run_with(s, script) == 130


def test_liveness_failures_in_a_row_stop_the_unit(tmp_path):
    async def prober(host, port, path, timeout):
        if path == "/healthz" and port == 9001:
            return ProbeResult(None, error="no answer within 1 s")
        return ProbeResult(200, b"{}")

    s, fake, out = make(tmp_path, prober=prober, liveness_failures=3)
    assert run_with(s, lambda: None) == 4
    assert b"b: liveness miss 3/3" in out.getvalue()
    assert s.stop_reason.startswith("b failed 3 liveness probes in a row")


def test_startup_timeout(tmp_path):
    async def prober(host, port, path, timeout):
        return ProbeResult(503 if port == 9000 else 200, b"{}")

    s, fake, out = make(tmp_path, prober=prober, startup_timeout_s=0.1)

    def advance():
        fake.t = 1.0  # the scripted clock passes the deadline

    assert run_with(s, advance) == 3
    assert b"a not ready after 0.1 s (last probe: /readyz answered 503)" in out.getvalue()

"""The unit under attack and what watches it, for bench/attack_soak.py.

A real `onecard run` of configs/default.toml inside a real memory cgroup, with three changes
that a shared machine needs and that change no limit: free ports instead of 7860-7863 (other
runs may hold those), the control socket in a private directory, and the probe port on
127.0.0.1 (the default binds every interface). Beside it, three observer processes
(bench/attack_probers.py: the orchestrator's probes, the public /healthz prober, a legitimate
client) and one sampling thread here (RSS of every process, the cgroup's usage, every 100 ms).
`Window` cuts all of that into the figures of one attack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import ROOT, SupervisorRun, free_port
from tests.memory_cgroup import MemoryCgroup, make_memory_cgroup, remove_memory_cgroup

GIB = 2**30
MIB = 2**20
SERVICES = ("detect", "img2img", "jobs")


def default_config() -> dict[str, Any]:
    return tomllib.loads((ROOT / "configs" / "default.toml").read_text())


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """RSS of each process and the cgroup's usage every `period` s, kept with their times."""

    def __init__(self, pids: dict[str, int], group: MemoryCgroup, period: float = 0.1):
        super().__init__(daemon=True, name="rss-sampler")
        self.pids, self.group, self.period = dict(pids), group, period
        self.samples: list[tuple[float, dict[str, int | None]]] = []
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.period):
            row = {name: _rss(pid) for name, pid in self.pids.items()}
            row["cgroup"] = self.group.usage()
            self.samples.append((time.monotonic(), row))

    def stop(self) -> None:
        self._stop.set()

    def now(self) -> dict[str, int | None]:
        row = {name: _rss(pid) for name, pid in self.pids.items()}
        row["cgroup"] = self.group.usage()
        return row

    def floor(self, seconds: float = 1.0) -> dict[str, int | None]:
        """Each process's lowest RSS over the last ``seconds`` (now when there is no sample):
        what it holds, not a legitimate request's working memory caught at the instant of one
        reading (the once-a-second 64x64 request adds about 60 MiB to detect while it runs)."""
        now = self.now()
        t1 = time.monotonic()
        out: dict[str, int | None] = dict(now)
        for t, row in list(self.samples):
            if t >= t1 - seconds:
                for k, v in row.items():
                    if v is not None and (out.get(k) is None or v < out[k]):
                        out[k] = v
        return out

    def peak(self, t0: float, t1: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for t, row in self.samples:
            if t0 <= t <= t1:
                for k, v in row.items():
                    if v is not None:
                        out[k] = max(out.get(k, 0), v)
        return out


def read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    except OSError:
        pass
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    data = sorted(values)
    return round(data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))], 1)


class Unit:
    """One run of the unit in its cgroup, with its observers; `restart()` after a death."""

    def __init__(self, limit: int = 8 * GIB, settings: dict[str, dict] | None = None):
        self.limit = limit
        self.extra_settings = settings or {}
        self.group: MemoryCgroup | None = None
        self.run: SupervisorRun | None = None
        self.observers: list[subprocess.Popen] = []
        self.sampler: Sampler | None = None
        self.deaths: list[dict] = []
        self.log_offset = 0

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> Unit:
        self.group = make_memory_cgroup(self.limit)
        if self.group is None:
            raise SystemExit("cannot make a memory cgroup here (run as root on a host with the memory controller)")
        cfg = default_config()
        self.tmp = Path(tempfile.mkdtemp(prefix="onecard-attack-"))
        self.ports = {name: free_port() for name in SERVICES}
        services = {}
        for name, svc in cfg["services"].items():
            svc = dict(svc)
            svc["port"] = self.ports[name]
            svc["settings"] = {**svc.get("settings", {}), **self.extra_settings.get(name, {})}
            services[name] = svc
        sup = dict(cfg["supervisor"])
        sup.update(health_port=free_port(), health_host="127.0.0.1", sample_period_s=5.0)
        self.health_port = sup["health_port"]
        self.run = SupervisorRun(self.tmp, services, prefix=self.group.prefix(), gpu=cfg.get("gpu"), **sup)
        self.run.start()
        t0 = time.monotonic()
        self.run.wait_ready(timeout=600)
        self.ready_s = time.monotonic() - t0
        self.pids = {"supervisor": self.run.proc.pid}
        self.pids.update({s["name"]: s["pid"] for s in self.run.status_doc()["services"]})
        self._start_observers()
        self.sampler = Sampler(self.pids, self.group)
        self.sampler.start()
        time.sleep(3)  # the observers' first lines
        return self

    def _start_observers(self) -> None:
        self.files = {k: self.tmp / f"{k}.jsonl" for k in ("orchestrator", "public", "legit")}
        py = [sys.executable, "-m", "bench.attack_probers"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmds = [py + ["orchestrator", "--port", str(self.health_port), "--out", str(self.files["orchestrator"])],
                py + ["public", *sum((["--port", str(self.ports[n])] for n in SERVICES), []),
                      "--out", str(self.files["public"])],
                py + ["legit", "--port", str(self.ports["detect"]), "--service", "detect",
                      "--port", str(self.ports["img2img"]), "--service", "img2img", "--out", str(self.files["legit"])]]
        self.observers = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True) for c in cmds]

    def stop(self) -> None:
        for p in self.observers:
            p.kill()
            p.wait()
        self.observers = []
        if self.sampler:
            self.sampler.stop()
        if self.run:
            self.run.stop()
        if self.group:
            remove_memory_cgroup(self.group)

    def restart(self, why: str) -> None:
        self.deaths.append({"why": why, "exit": self.run.proc.returncode if self.run else None,
                            "log_tail": self.log_tail(4000)})
        self.stop()
        self.start()

    # ---- facts ----------------------------------------------------------------------------
    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def alive(self) -> bool:
        return self.run is not None and self.run.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.run.proc.poll() if self.run else None

    def log_size(self) -> int:
        try:
            return self.run.log_path.stat().st_size
        except OSError:
            return 0

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.run.output()[-n:]
        except OSError:
            return ""

    def service_pids(self) -> dict[str, int]:
        try:
            return {s["name"]: s["pid"] for s in self.run.status_doc()["services"]}
        except Exception:  # noqa: BLE001 - a dead supervisor answers nothing
            return {}


@dataclass
class Window:
    """The figures of one attack, from the observers' lines between t0 and t1 (the attack) and
    up to t_after (the settle time)."""
    unit: Unit
    name: str
    t0: float = field(default_factory=time.monotonic)
    before: dict[str, int | None] = field(default_factory=dict)
    log0: int = 0
    oom0: int = 0

    def open(self) -> Window:
        self.before = self.unit.sampler.floor()
        self.log0 = self.unit.log_size()
        self.oom0 = self.unit.group.oom_kills()
        self.peak_reset = self.unit.group.reset_peak()
        self.t0 = time.monotonic()
        return self

    def close(self, t1: float, settle_s: float = 10.0) -> dict[str, Any]:
        u = self.unit
        alive_at_end = u.alive()
        deadline = t1 + settle_s
        while time.monotonic() < deadline and u.alive():
            time.sleep(0.2)
        t_after = time.monotonic()
        after = u.sampler.floor() if u.alive() else {}
        peaks = u.sampler.peak(self.t0, t_after)
        orch = [r for r in read_jsonl(u.files["orchestrator"]) if self.t0 <= r["t"] <= t_after]
        public = [r for r in read_jsonl(u.files["public"]) if self.t0 <= r["t"] <= t1]
        legit = [r for r in read_jsonl(u.files["legit"]) if self.t0 <= r["t"] <= t1]
        by_port = {p: n for n, p in u.ports.items()}
        health: dict[str, dict] = {}
        for name in SERVICES:
            rows = [r for r in public if by_port.get(r["port"]) == name]
            ms = [r["ms"] for r in rows if r["ok"]]
            health[name] = {"n": len(rows), "failed": sum(not r["ok"] for r in rows), "p50_ms": pct(ms, 50),
                            "p99_ms": pct(ms, 99), "max_ms": max(ms) if ms else None,
                            "failures": sorted({f"{r['status']} {r['error'] or ''}".strip()
                                                for r in rows if not r["ok"]})[:5]}
        legit_out: dict[str, dict] = {}
        for name in ("detect", "img2img"):
            rows = [r for r in legit if by_port.get(r["port"]) == name]
            statuses: dict[str, int] = {}
            for r in rows:
                key = str(r["status"] or r["error"]) + (f" {r['error']}" if r["status"] and r["error"] else "")
                statuses[key] = statuses.get(key, 0) + 1
            ms = [r["ms"] for r in rows]
            legit_out[name] = {"n": len(rows), "statuses": statuses, "p50_ms": pct(ms, 50),
                               "max_ms": max(ms) if ms else None}
        cg_peak = u.group.peak() if self.peak_reset else None
        return {
            "attack_s": round(t1 - self.t0, 1),
            "unit_alive": alive_at_end and u.alive(), "unit_exit": u.exit_code(),
            "oom_kills": u.group.oom_kills() - self.oom0,
            "orchestrator": {"probes": len(orch), "failed": sum(not r["ok"] for r in orch),
                             "failed_healthz": sum(not r["ok"] for r in orch if r["path"] == "/healthz"),
                             "failed_readyz": sum(not r["ok"] for r in orch if r["path"] == "/readyz"),
                             "max_ms": max((r["ms"] for r in orch), default=None)},
            "public_healthz": health, "legit": legit_out,
            "rss_before_mib": {k: _mib(v) for k, v in self.before.items()},
            "rss_peak_mib": {k: _mib(v) for k, v in peaks.items()},
            "cgroup_peak_mib": _mib(cg_peak),
            "rss_after_mib": {k: _mib(v) for k, v in after.items()},
            "log_bytes": u.log_size() - self.log0,
        }


def _mib(v: int | None) -> float | None:
    return None if v is None else round(v / MIB, 1)

"""Supervisor benchmarks: death-detection latency, `onecard status` wall time, idle cost.

    .venv/bin/python -m bench.supervisor_bench [--trials 50] [--idle-s 30]

Runs real supervisors with the test suite's tiny child service, prints a table and
writes bench/results/supervisor.json. Targets (issue 2): detection median <= 50 ms,
status <= 0.3 s, idle CPU <= 0.2 % of a core, RSS <= 60 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.harness import SupervisorRun, fake_service  # noqa: E402


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def detection_trial(tmp: Path) -> tuple[float, float]:
    """(kill -> supervisor logs the death, kill -> supervisor process gone), seconds."""
    services = {"victim": fake_service(), "other": fake_service()}
    with SupervisorRun(tmp, services, extra_args=["--log-format", "json"], liveness_period_s=5.0) as run:
        run.wait_ready()
        victim = run.child_pid("victim")
        t_kill = time.time()
        t_kill_mono = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        run.wait_exit(10)
        gone = time.monotonic() - t_kill_mono
        for line in run.output().splitlines():
            rec = json.loads(line)
            if rec["source"] == "onecard" and rec["msg"].startswith("victim: exited"):
                return rec["ts"] - t_kill, gone
    raise RuntimeError("death was not logged")


def status_times(run: SupervisorRun, n: int) -> list[float]:
    exe = [sys.executable, "-m", "supervisor", "status", "--socket", run.socket]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(exe, cwd=ROOT, capture_output=True, check=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "supervisor.json"))
    args = ap.parse_args()

    detect, gone = [], []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as d:
            a, b = detection_trial(Path(d))
        detect.append(a)
        gone.append(b)
        print(f"trial {i + 1}/{args.trials}: detected {a * 1000:.1f} ms, supervisor gone {b * 1000:.0f} ms",
              file=sys.stderr)

    with tempfile.TemporaryDirectory() as d:
        # production probe cadence (configs/default.toml): the idle cost is what users pay
        with SupervisorRun(Path(d), {"a": fake_service(), "b": fake_service()},
                           liveness_period_s=5.0, sample_period_s=5.0) as run:
            run.wait_ready()
            st = status_times(run, 20)
            time.sleep(2)
            sup = psutil.Process(run.proc.pid)
            c0 = sum(sup.cpu_times()[:2])
            t0 = time.monotonic()
            time.sleep(args.idle_s)
            idle_cpu = 100 * (sum(sup.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
            rss = sup.memory_info().rss

    result = {
        # what bench.common.write_result stamps on every other result file
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "detection_ms": {"median": 1000 * statistics.median(detect), "p99": 1000 * pct(detect, 99),
                         "trials": len(detect)},
        "supervisor_gone_after_death_ms": {"median": 1000 * statistics.median(gone), "p99": 1000 * pct(gone, 99)},
        "status_wall_s": {"median": statistics.median(st), "max": max(st), "runs": len(st)},
        "idle_cpu_percent_of_core": idle_cpu,
        "idle_window_s": args.idle_s,
        "supervisor_rss_mb": rss / 2**20,
        "targets": {"detection_median_ms": 50, "status_s": 0.3, "idle_cpu_percent": 0.2, "rss_mb": 60},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    rows = [
        ("death detection median", f"{result['detection_ms']['median']:.1f} ms", "<= 50 ms"),
        ("death detection p99", f"{result['detection_ms']['p99']:.1f} ms", ""),
        ("supervisor gone after death, median", f"{result['supervisor_gone_after_death_ms']['median']:.0f} ms",
         "<= 1000 ms"),
        ("supervisor gone after death, p99", f"{result['supervisor_gone_after_death_ms']['p99']:.0f} ms", "<= 1000 ms"),
        ("onecard status wall, median", f"{result['status_wall_s']['median']:.3f} s", "<= 0.3 s"),
        ("onecard status wall, max", f"{result['status_wall_s']['max']:.3f} s", ""),
        (f"supervisor idle CPU over {args.idle_s:g} s", f"{idle_cpu:.3f} % of a core", "<= 0.2 %"),
        ("supervisor RSS", f"{result['supervisor_rss_mb']:.1f} MB", "<= 60 MB"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'figure':>18}  target")
    for name, fig, tgt in rows:
        print(f"{name:<{w}}  {fig:>18}  {tgt}")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

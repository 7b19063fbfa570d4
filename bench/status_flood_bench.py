"""`onecard status` while services flood the log: wall time of the command and of the
control-socket answer, quiet and flooded, and what each logged line costs the supervisor.

    .venv/bin/python -m bench.status_flood_bench [--seconds 6] [--calls 10] [--log-format text]

Two `command` services print as fast as they can (`yes`); the supervisor's stdout is a file.
Prints one JSON document: medians and p90s in seconds, the flood/quiet ratios, and the
supervisor's CPU seconds per million lines. Timings depend on the host: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from supervisor.cli.status import fetch  # noqa: E402
from tests.harness import SupervisorRun, fake_service, free_port  # noqa: E402

LINE = "x" * 100


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def measure(run: SupervisorRun, calls: int) -> dict:
    cli, sock = [], []
    for _ in range(calls):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "supervisor", "status", "--socket", run.socket], cwd=ROOT,
                       capture_output=True)
        cli.append(time.perf_counter() - t)
        t = time.perf_counter()
        fetch(run.socket, timeout=10)
        sock.append(time.perf_counter() - t)
        time.sleep(0.3)
    return {"cli_median_s": statistics.median(cli), "cli_p90_s": pct(cli, 90),
            "socket_median_s": statistics.median(sock), "socket_p90_s": pct(sock, 90)}


def _ready(run: SupervisorRun, name: str) -> bool:
    try:
        return any(s["name"] == name and s["ready"] for s in fetch(run.socket)["services"])
    except Exception:  # noqa: BLE001 - not up yet
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--log-format", default="text")
    args = ap.parse_args()
    out = {}
    for phase in ("quiet", "flood"):
        with tempfile.TemporaryDirectory() as d:
            services = {"a": fake_service()}
            if phase == "flood":
                for name in ("f1", "f2"):
                    services[name] = {"command": ["sh", "-c", f"yes {LINE}"], "port": free_port()}
            with SupervisorRun(Path(d), services, log_format=args.log_format, startup_timeout_s=600) as run:
                run.wait_for("a to be ready", lambda: _ready(run, "a"))
                sup = psutil.Process(run.proc.pid)
                cpu0, lines0, t0 = sum(sup.cpu_times()[:2]), run.log_path.stat().st_size, time.monotonic()
                time.sleep(args.seconds / 2)
                out[phase] = measure(run, args.calls)
                time.sleep(args.seconds / 2)
                cpu = sum(sup.cpu_times()[:2]) - cpu0
                lines = (run.log_path.stat().st_size - lines0) / (len(LINE) + 12)
                if phase == "flood":
                    out[phase]["lines_per_s"] = round(lines / (time.monotonic() - t0))
                    out[phase]["supervisor_cpu_s_per_million_lines"] = round(cpu / max(lines, 1) * 1e6, 2)
    out["ratio_cli_flood_over_quiet"] = round(out["flood"]["cli_median_s"] / out["quiet"]["cli_median_s"], 2)
    out["ratio_socket_flood_over_quiet"] = round(out["flood"]["socket_median_s"] / out["quiet"]["socket_median_s"], 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

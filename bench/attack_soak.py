"""Attack soak: a real unit (configs/default.toml) in an 8 GiB memory cgroup, attacked class by
class as a hostile client without credentials would, while an orchestrator probes it.

    sudo .venv/bin/python -m bench.attack_soak [--only 5] [--skip B1] [--limit-gib 8] [--settle 10]

The unit: bench/attack_unit.py (what differs from configs/default.toml: free ports, a private
control socket, the probe port on 127.0.0.1). The attacks: the issue's classes
(bench/attack_classes.py) and our own (bench/attack_extra.py), one after another. For each:
the attackers' status codes (5xx?), whether the unit still runs (else its exit code, and a
fresh unit for the next attack), the orchestrator's failed probes, public /healthz p50/p99/max
per service during the attack, a legitimate 64x64 request's statuses and latency, per-process
peak RSS and the cgroup's peak, RSS 10 s after the attack against before (each the lowest of
the last second: not a legitimate request's working memory), and the bytes the unit logged.
Writes bench/results/attack_soak.json and prints a table.

Goals (the bounded-cost issue): 0 unit exits, 0 probe failures, 0 5xx, RSS within the budgets
and back near its start, /healthz p99 <= 20 ms. Timings from a shared 2-core machine are
pessimistic; the verdict flags are what to read.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from typing import Any

from bench.attack_classes import ISSUE_ATTACKS
from bench.attack_extra import OWN_ATTACKS
from bench.attack_more import MORE_ATTACKS
from bench.attack_net import count_5xx, request
from bench.attack_unit import GIB, MIB, SERVICES, Unit, Window
from bench.common import table, write_result

P99_GOAL_MS = 20.0
MIN_WINDOW_S = 3.0
RSS_BACK_MIB = 64          # "back near its start": within this, or within 10 %


def budgets(u: Unit) -> dict[str, float | None]:
    """Each service's host memory budget (MiB): what /info says, else what the supervisor
    planned for it (ONECARD_MEMORY_BUDGET_BYTES in its environment: the jobs service)."""
    out: dict[str, float | None] = {}
    for name in SERVICES:
        r = request(u.ports[name], "GET", "/info", timeout=10)
        try:
            b = json.loads(r["body"]).get("memory_budgets") or {}
            out[name] = round(b["service_bytes"] / MIB, 1) if b.get("service_bytes") else None
        except (ValueError, KeyError, TypeError, AttributeError):
            out[name] = None
        if out[name] is None:
            try:
                env = open(f"/proc/{u.pids[name]}/environ", "rb").read().split(b"\0")
                planned = next(v for v in env if v.startswith(b"ONECARD_MEMORY_BUDGET_BYTES="))
                out[name] = round(int(planned.split(b"=", 1)[1]) / MIB, 1)
            except (OSError, StopIteration, ValueError, KeyError):
                pass
    return out


def verdict(row: dict[str, Any], limits: dict[str, float | None]) -> list[str]:
    flags = []
    if not row["unit_alive"]:
        flags.append(f"EXIT {row['unit_exit']}")
    if row["oom_kills"]:
        flags.append(f"OOM x{row['oom_kills']}")
    if row["orchestrator"]["failed"]:
        flags.append(f"probes failed {row['orchestrator']['failed']}")
    if row["five_xx"]:
        flags.append(f"5xx x{row['five_xx']}")
    slow = [n for n, h in row["public_healthz"].items() if (h["p99_ms"] or 0) > P99_GOAL_MS or h["failed"]]
    if slow:
        flags.append("healthz p99>20ms: " + ",".join(slow))
    bad_legit = [n for n, lg in row["legit"].items() if any(k != "200" for k in lg["statuses"])]
    if bad_legit:
        flags.append("legit refused: " + ",".join(bad_legit))
    for name, cap in limits.items():
        peak = row["rss_peak_mib"].get(name)
        if cap and peak and peak > cap:
            flags.append(f"{name} RSS {peak:.0f}>{cap:.0f} MiB budget")
    for name in SERVICES:
        b, a = row["rss_before_mib"].get(name), row["rss_after_mib"].get(name)
        if b and a and a - b > max(RSS_BACK_MIB, 0.1 * b):
            flags.append(f"{name} RSS +{a - b:.0f} MiB after")
    return flags


def run_attack(u: Unit, name: str, fn, ctx: dict, settle_s: float) -> dict[str, Any]:
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare(u, ctx)
    w = Window(u, name).open()
    try:
        got = fn(u, ctx)
    except Exception as exc:  # noqa: BLE001 - a broken attack is reported, the soak goes on
        got = {"statuses": {}, "notes": {"bench_error": f"{exc!r}", "trace": traceback.format_exc()[-1500:]}}
    left = MIN_WINDOW_S - (time.monotonic() - w.t0)
    if left > 0:  # enough public probes in the window to say something about latency
        time.sleep(left)
    row = w.close(time.monotonic(), settle_s)
    row.update(name=name, statuses=got["statuses"], notes=got["notes"], five_xx=count_5xx(got["statuses"]))
    return row


def print_table(rows: list[dict], limits: dict) -> None:
    def ms(h):
        return "/".join("-" if h[n]["p99_ms"] is None else f"{h[n]['p99_ms']:.0f}" for n in SERVICES)

    def mx(h):
        return "/".join("-" if h[n]["max_ms"] is None else f"{h[n]['max_ms']:.0f}" for n in SERVICES)

    def mib(d):
        return "/".join("-" if d.get(n) is None else f"{d[n]:.0f}" for n in SERVICES)

    def delta(r):
        return "/".join("-" if r["rss_after_mib"].get(n) is None or r["rss_before_mib"].get(n) is None
                        else f"{r['rss_after_mib'][n] - r['rss_before_mib'][n]:+.0f}" for n in SERVICES)

    def legit(r):
        return " ".join(f"{n[0]}:{'/'.join(f'{k}x{v}' for k, v in lg['statuses'].items()) or '-'}"
                        f"@{(lg['max_ms'] or 0) / 1000:.1f}s" for n, lg in r["legit"].items())
    print(table([(r["name"][:38], r["five_xx"], "run" if r["unit_alive"] else f"EXIT {r['unit_exit']}",
                  r["orchestrator"]["failed"], ms(r["public_healthz"]), mx(r["public_healthz"]), legit(r),
                  mib(r["rss_peak_mib"]), f"{r['cgroup_peak_mib'] or 0:.0f}", delta(r), r["log_bytes"])
                 for r in rows],
                ("attack", "5xx", "unit", "probe fail", "healthz p99 d/i/j ms", "max ms", "legit (status x n @max)",
                 "peak RSS d/i/j MiB", "cgroup peak", "RSS after-before", "log B")))
    print(f"\nbudgets (MiB; /info, else the supervisor's plan): {limits}")
    for r in rows:
        flags = verdict(r, limits)
        print(f"- {r['name']}: {'OK' if not flags else 'FAIL: ' + '; '.join(flags)}")
        print(f"    statuses {r['statuses']}  notes {json.dumps(r['notes'], default=str)[:600]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", default=[], help="run attacks whose name starts with this")
    ap.add_argument("--skip", action="append", default=[], help="skip attacks whose name starts with this")
    ap.add_argument("--limit-gib", type=float, default=8.0)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after an attack before RSS is read")
    ap.add_argument("--repeat", type=int, default=1, help="run the chosen attacks this many times (their spread)")
    ap.add_argument("--name", default="attack_soak")
    ap.add_argument("--budgets-from", help='with --report: budgets to judge by, JSON {"jobs": 1638.4}')
    ap.add_argument("--report", help="print the table of a saved result file (judged again) and exit")
    args = ap.parse_args(argv)
    if args.report:
        doc = json.load(open(args.report))
        if args.budgets_from:
            doc["budgets_mib"].update(json.loads(args.budgets_from))
        print_table(doc["attacks"], doc["budgets_mib"])
        return 0
    attacks = [(n, f) for n, f in ISSUE_ATTACKS + OWN_ATTACKS + MORE_ATTACKS
               if (not args.only or any(n.startswith(o) for o in args.only))
               and not any(n.startswith(s) for s in args.skip)]
    if args.repeat > 1:
        attacks = [(f"{n} #{k + 1}", f) for k in range(args.repeat) for n, f in attacks]
    def stopped(signum, frame):  # killed or timed out: the finally below still stops the unit and its probers
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stopped)
    u = Unit(limit=int(args.limit_gib * GIB))
    rows: list[dict] = []
    limits: dict = {}
    try:
        u.start()
        limits = budgets(u)
        print(f"unit ready in {u.ready_s:.0f} s; ports {u.ports}, probe port {u.health_port}; budgets {limits}",
              flush=True)
        ctx: dict[str, Any] = {}
        for name, fn in attacks:
            print(f"== {name}", flush=True)
            row = run_attack(u, name, fn, ctx, args.settle)
            rows.append(row)
            print(f"   {row['statuses']} alive={row['unit_alive']} probes failed={row['orchestrator']['failed']} "
                  f"flags={verdict(row, limits)}", flush=True)
            if not u.alive():
                row["log_tail"] = u.log_tail(3000)
                print(f"   unit exited {u.exit_code()}; starting a fresh one", flush=True)
                u.restart(name)
                ctx.clear()
    finally:
        deaths = u.deaths
        u.stop()
    doc = {"limit_bytes": int(args.limit_gib * GIB), "budgets_mib": limits, "goals": {
        "unit_exits": 0, "probe_failures": 0, "five_xx": 0, "healthz_p99_ms": P99_GOAL_MS,
        "rss_back_within_mib": RSS_BACK_MIB},
        "note": "2 shared cores with other work running: latencies are pessimistic",
        "attacks": [{**r, "flags": verdict(r, limits)} for r in rows], "deaths": deaths}
    path = write_result(args.name, doc)
    print_table(rows, limits)
    print(f"written: {path}")
    return 0 if all(not verdict(r, limits) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

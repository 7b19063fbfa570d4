"""Batching against a simulated accelerator (bench/simaccel.py): served / ideal and latency.

For each cost profile, the service runs with the default policy (auto) and, side by side,
with a fixed fill window of 0 and of 150 ms, and with batching off; closed-loop clients
(each sends its next request when it has its answer: a 512x512 JPEG in, a PNG out) at
1, 2, 4, 8, 16 and 32, for `--duration` seconds per level. "Ideal" is what back-to-back
full batches would serve: c / (A + B (c - 1)) for c <= max_batch_size, else
max / (A + B (max - 1)).

    .venv/bin/python -m bench.batching_bench                       # every profile, 15 s a level
    .venv/bin/python -m bench.batching_bench --profiles sd15-h100 --duration 5 --clients 1 4 8

Goals (issue: batching that knows what a batch costs): with a sub-linear curve >= 0.9 of
ideal from 2 to 32 clients, and at 1 client >= 0.97 of the same service with batching off;
detector >= 0.9 at 32 clients; linear p50 at 1 and 8 clients within 5 % of batching off.
Results: bench/results/batching.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import sys

import httpx

from bench.common import service, table, write_result
from bench.loadgen import run_load_sync
from bench.simaccel import PROFILES
from tests.images import astronaut, encode

APP = "bench.simaccel:create_app"
MAX_BATCH = 8
POLICIES = {"auto": {"batch_policy": "auto"}, "fixed-0": {"batch_policy": "fixed", "max_wait_ms": 0},
            "fixed-150": {"batch_policy": "fixed", "max_wait_ms": 150}, "off": {"max_batch_size": 1}}


def ideal(profile: str, clients: int) -> float:
    a, b = PROFILES[profile]
    c = min(clients, MAX_BATCH)
    return c / (a + b * (c - 1))


def run_policy(profile: str, policy: str, levels: list[int], duration: float, body: bytes) -> list[dict]:
    settings = {"profile": profile, "max_batch_size": MAX_BATCH, "max_queue": 64, "request_timeout_s": 120,
                **POLICIES[policy]}
    rows = []
    with service(APP, settings, threads=2) as svc:
        url = f"{svc.url}/api/v1/sim"
        for clients in levels:
            calls_before = httpx.get(svc.url + "/calls").json()["calls"]
            res = run_load_sync(url, body, {"content-type": "image/jpeg"}, clients, duration_s=duration,
                                warmup=1)
            stats = httpx.get(svc.url + "/stats").json()["batching"]
            calls = httpx.get(svc.url + "/calls").json()
            served = res.throughput
            row = {"profile": profile, "policy": policy, "clients": clients, "served_rps": round(served, 3),
                   "ideal_rps": round(ideal(profile, clients), 3),
                   "served_over_ideal": round(served / ideal(profile, clients), 3),
                   "p50_ms": res.summary()["p50_ms"], "p99_ms": res.summary()["p99_ms"],
                   "errors": res.errors, "statuses": res.summary()["statuses"],
                   "calls": calls["calls"] - calls_before, "waited_s": stats["waited_s"],
                   "curve": stats["cost"]["time"]}
            rows.append(row)
            print(f"  {profile:10s} {policy:9s} c={clients:<3d} served/ideal {row['served_over_ideal']:.3f} "
                  f"p50 {row['p50_ms']} ms p99 {row['p99_ms']} ms calls {row['calls']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", nargs="*", default=list(PROFILES))
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    ap.add_argument("--clients", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--name", default="batching")
    args = ap.parse_args()
    body = encode(astronaut(), "JPEG", quality=90)
    rows: list[dict] = []
    for profile in args.profiles:
        for policy in args.policies:
            levels = args.clients if policy != "off" else [c for c in args.clients if c in (1, 8)] or [1]
            rows += run_policy(profile, policy, levels, args.duration, body)
    off = {(r["profile"], r["clients"]): r for r in rows if r["policy"] == "off"}
    for r in rows:
        base = off.get((r["profile"], r["clients"]))
        if base and r["policy"] != "off":
            r["served_over_off"] = round(r["served_rps"] / base["served_rps"], 3) if base["served_rps"] else None
            r["p50_over_off"] = round(r["p50_ms"] / base["p50_ms"], 3) if base["p50_ms"] else None
    path = write_result(args.name, {"duration_s": args.duration, "max_batch_size": MAX_BATCH, "rows": rows})
    print(table([(r["profile"], r["policy"], r["clients"], r["served_over_ideal"], r.get("served_over_off", ""),
                  r["p50_ms"], r["p99_ms"]) for r in rows],
                ("profile", "policy", "clients", "served/ideal", "served/off", "p50 ms", "p99 ms")))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

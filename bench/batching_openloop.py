"""Batching under open-loop arrivals against the simulated accelerator (bench/simaccel.py):
requests arrive on their own clock, not when an answer comes back, as Poisson arrivals at a
rate or as bursts of six, and the latency each policy gives them is compared side by side
(auto, a fixed fill window of 0 and of 150 ms). Throughput is the arrival rate whatever the
policy (every rate here is under the card's capacity); what differs is how long requests wait.

    .venv/bin/python -m bench.batching_openloop                    # sd15-h100 and the detector
    .venv/bin/python -m bench.batching_openloop --duration 10

Results: bench/results/batching-openloop.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import random
import statistics
import sys
import time

from bench.batching_bench import APP, MAX_BATCH, POLICIES
from bench.common import service, table, write_result
from tests.images import astronaut, encode

BURST = 6
# (profile, pattern, requests a second): SD at about a third and two thirds of what full
# batches serve (7.3/s), the detector at rates this 2-core load generator can send
RUNS = (("sd15-h100", "poisson", 2.0), ("sd15-h100", "poisson", 5.0), ("sd15-h100", "bursts", 3.0),
        ("sd15-h100", "bursts", 5.0), ("detector", "poisson", 30.0), ("detector", "poisson", 80.0))


def _one(port: int, body: bytes) -> tuple[float, int]:
    t = time.perf_counter()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/api/v1/sim", body, {"content-type": "image/jpeg"})
        r = c.getresponse()
        r.read()
        c.close()
        return time.perf_counter() - t, r.status
    except OSError:
        return time.perf_counter() - t, 0


def run(profile: str, policy: str, pattern: str, rate: float, duration: float, body: bytes) -> dict:
    settings = {"profile": profile, "max_batch_size": MAX_BATCH, "max_queue": 256, "request_timeout_s": 120,
                **POLICIES[policy]}
    with service(APP, settings, threads=2) as svc:
        port = int(svc.url.rsplit(":", 1)[1])
        for _ in range(3):
            _one(port, body)
        rng = random.Random(1)          # the same arrivals for every policy
        futures = []
        with concurrent.futures.ThreadPoolExecutor(128) as pool:
            t0, t = time.perf_counter(), 0.0
            while t < duration:
                t += rng.expovariate(rate) if pattern == "poisson" else BURST / rate
                time.sleep(max(0.0, t0 + t - time.perf_counter()))
                for _ in range(1 if pattern == "poisson" else BURST):
                    futures.append(pool.submit(_one, port, body))
            results = [f.result() for f in futures]
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/stats")
        stats = json.loads(c.getresponse().read())["batching"]
    lat = sorted(s for s, status in results if status == 200)
    n = len(lat)
    return {"profile": profile, "policy": policy, "pattern": pattern, "rate": rate, "requests": len(results),
            "failed": len(results) - n, "mean_ms": round(1000 * statistics.mean(lat), 1),
            "p50_ms": round(1000 * lat[n // 2], 1), "p99_ms": round(1000 * lat[int(0.99 * (n - 1))], 1),
            "mean_batch": stats["mean_batch_size"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--policies", nargs="*", default=["auto", "fixed-0", "fixed-150"])
    args = ap.parse_args()
    body = encode(astronaut(), "JPEG", quality=90)
    rows = []
    for profile, pattern, rate in RUNS:
        for policy in args.policies:
            row = run(profile, policy, pattern, rate, args.duration, body)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table([(r["profile"], r["pattern"], r["rate"], r["policy"], r["mean_ms"], r["p50_ms"], r["p99_ms"],
                  r["mean_batch"], r["failed"]) for r in rows],
                ("profile", "arrivals", "per s", "policy", "mean ms", "p50 ms", "p99 ms", "mean batch", "failed")))
    print("results:", write_result("batching-openloop", {"duration_s": args.duration, "burst": BURST, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The jobs API: what it adds to a direct call, and throughput with 1, 2 and 4 units.

    .venv/bin/python -m bench.jobs_bench [--rounds 20] [--jobs 240] [--units 1 2 4]

Overhead (goal: <= 5 ms p50 added per job): one unit, concurrency 1, on a service that does
no work (what the jobs path itself costs) and on detect with Haar on a 160 px image (a real
service, its own time on both sides). Direct calls and jobs are interleaved round by round
so that both see the same machine state. A job's time is the client's: submit, then one long poll
(GET /v1/jobs/{id}?wait=30) that answers with the result inline once the job is finished;
"inside" is the server's own view (finished_at - created_at).
Measured for the embedded queue and for Redis.

Throughput: N units (each a jobs service + its own services) on one Redis, a burst of jobs
submitted at once, time from the first submit to the last finish (server timestamps). Two
workloads: a GPU-like job (the service sleeps 200 ms without using the CPU, one at a time
per unit, as a GPU serializes work) shows the scale-out itself; a CPU detect job shows what
this machine's cores allow. Units run on one machine here; on GPU nodes each has its own card.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from bench.common import pct, table, write_result
from tests.images import astronaut, encode
from tests.jobs_harness import DETECT_APP, TARGET_APP, Unit, b64, start_units
from tests.redis_server import RedisServer

HAAR = "detect/haar/haarcascade_frontalface_default"  # the label drops the file's extension


def small_face() -> str:
    return b64(encode(np.asarray(Image.fromarray(astronaut()).resize((160, 160)))))


def wait_done(api: httpx.Client, job_id: str, result: bool = False) -> dict:
    """The client's way to a result: long polls (GET ?wait=) until the job is finished."""
    while True:
        doc = api.get(f"/v1/jobs/{job_id}", params={"wait": 30, "result": str(result).lower()}, timeout=60).json()
        if doc["state"] in ("succeeded", "failed", "cancelled"):
            return doc


WORKLOADS = {
    # a service that does no work: what the jobs path itself costs
    "echo": ({"scripted": (TARGET_APP, {"model": "echo", "dry_run": True})}, "/api/v1/work",
             lambda: {}, lambda doc: "tag" in doc),
    # a real one: CPU Haar detection of a 160 px image, its own time included on both sides
    "detect": ({"detect": (DETECT_APP, {"backend": "haar", "warmup_runs": 2})}, "/api/v1/facedetect",
               lambda: {"image": small_face()}, lambda doc: doc["width"] == 160),
}


def overhead(tmp: Path, queue: dict, workload: str, rounds: int, per_round: int) -> dict:
    targets, route, make_body, valid = WORKLOADS[workload]
    u = Unit(tmp, "bench", targets, queue=queue)
    try:
        start_units(u)
        name = next(iter(targets))
        service_body = make_body()
        direct_url = u.targets[name].url + route
        direct_client = httpx.Client(trust_env=False, timeout=30)
        body = {"service": name, "route": route, "body": service_body}
        for _ in range(5):  # warm both paths
            direct_client.post(direct_url, json=service_body)
            wait_done(u.api, u.api.post("/v1/jobs", json=body).json()["id"], True)
        direct, job, inside = [], [], []
        for _ in range(rounds):
            for _ in range(per_round):
                t = time.perf_counter()
                r = direct_client.post(direct_url, json=service_body)
                direct.append(time.perf_counter() - t)
                assert r.status_code == 200 and valid(r.json())
            for _ in range(per_round):
                t = time.perf_counter()
                job_id = u.api.post("/v1/jobs", json=body).json()["id"]
                doc = wait_done(u.api, job_id, True)
                job.append(time.perf_counter() - t)
                assert doc["state"] == "succeeded" and valid(doc["result"]), doc
                inside.append(doc["finished_at"] - doc["created_at"])
        direct_client.close()
        d50, j50 = statistics.median(direct), statistics.median(job)
        return {"workload": workload, "direct_p50_ms": 1000 * d50, "direct_p99_ms": 1000 * pct(direct, 99),
                "job_p50_ms": 1000 * j50, "job_p99_ms": 1000 * pct(job, 99),
                "inside_p50_ms": 1000 * statistics.median(inside),
                "added_p50_ms": 1000 * (j50 - d50), "samples": len(job)}
    finally:
        u.stop()


def throughput(tmp: Path, server: RedisServer, units: int, jobs: int, workload: str, prefix: str) -> dict:
    queue = {"url": server.url, "prefix": prefix, "visibility_timeout_s": 30}
    if workload == "gpu-like":
        targets = {"scripted": (TARGET_APP, {"model": "gpu"})}
        extra = {"target_settings": {"scripted": {"max_in_flight": 1}}}
        body = {"service": "scripted", "route": "/api/v1/work", "body": {"sleep_s": 0.2}}
    else:
        targets = {"detect": (DETECT_APP, {"backend": "haar", "warmup_runs": 2})}
        extra = {}
        body = {"service": "detect", "route": "/api/v1/facedetect", "model": HAAR, "image": small_face()}
    fleet = [Unit(tmp, f"u{i}", targets, queue=queue, **extra) for i in range(units)]
    try:
        start_units(*fleet)
        api = fleet[0].api

        def submit(i: int) -> str:
            r = fleet[i % units].api.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            return r.json()["id"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(submit, range(jobs)))
        docs = [wait_done(api, job_id) for job_id in ids]
        assert all(d["state"] == "succeeded" for d in docs)
        span = max(d["finished_at"] for d in docs) - min(d["created_at"] for d in docs)
        per_node: dict[str, int] = {}
        for d in docs:
            per_node[d["node"]] = per_node.get(d["node"], 0) + 1
        return {"units": units, "workload": workload, "jobs": jobs, "seconds": span, "jobs_per_s": jobs / span,
                "per_unit": sorted(per_node.values())}
    finally:
        for u in fleet:
            u.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=240)
    ap.add_argument("--units", type=int, nargs="*", default=[1, 2, 4])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="onecard-jobs-bench-"))
    with RedisServer(tmp) as server:
        over = []
        for workload in WORKLOADS:
            for mode, queue in (("embedded", {}), ("redis", {"url": server.url, "prefix": f"over-{workload}"})):
                over.append({"queue": mode, **overhead(tmp, queue, workload, args.rounds, args.per_round)})
        rows = [(o["workload"], o["queue"], f"{o['direct_p50_ms']:.2f}", f"{o['job_p50_ms']:.2f}",
                 f"{o['added_p50_ms']:.2f}", f"{o['inside_p50_ms']:.2f}", f"{o['job_p99_ms']:.2f}", o["samples"])
                for o in over]
        print(table(rows, ("workload", "queue", "direct p50 ms", "job p50 ms", "added p50 ms", "inside p50 ms",
                           "job p99 ms", "jobs")))
        scale = []
        for workload in ("gpu-like", "cpu-detect"):
            for n in args.units:
                scale.append(throughput(tmp, server, n, args.jobs, workload, f"tp-{workload}-{n}"))
        base = {s["workload"]: s["jobs_per_s"] for s in scale if s["units"] == args.units[0]}
        rows = [(s["workload"], s["units"], f"{s['jobs_per_s']:.1f}", f"{s['jobs_per_s'] / base[s['workload']]:.2f}",
                 s["per_unit"]) for s in scale]
        print(table(rows, ("workload", "units", "jobs/s", f"vs {args.units[0]} unit", "jobs per unit")))
    path = write_result("jobs", {"overhead": over, "throughput": scale})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

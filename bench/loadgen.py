"""A bounded load generator for our own benchmarks and soak runs (local addresses only).

Every run is bounded in count and time and stops by itself. `python -m bench.loadgen`
drives one endpoint from the command line; the benchmarks import `run_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0           # connection-level failures (no HTTP answer)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> int:
        return sum(n for s, n in self.statuses.items() if s < 400)

    @property
    def throughput(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s else 0.0

    def pct(self, q: float) -> float | None:
        if not self.latencies_s:
            return None
        data = sorted(self.latencies_s)
        return data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))]

    def summary(self) -> dict:
        return {"requests": sum(self.statuses.values()) + self.errors, "ok": self.ok,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())}, "errors": self.errors,
                "elapsed_s": round(self.elapsed_s, 3), "throughput_rps": round(self.throughput, 2),
                "p50_ms": _ms(self.pct(50)), "p95_ms": _ms(self.pct(95)), "p99_ms": _ms(self.pct(99)),
                "mean_ms": _ms(statistics.fmean(self.latencies_s)) if self.latencies_s else None}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def check_local(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"loadgen only targets this machine (127.0.0.1/localhost), not {host!r}")


def run_load_sync(url: str, body: bytes | Callable[[int], bytes], headers: dict[str, str], concurrency: int,
                  total: int | None = None, duration_s: float | None = None, timeout_s: float = 120.0,
                  warmup: int = 0) -> LoadResult:
    """POST `body` to `url` from `concurrency` threads, each with one kept-alive
    http.client connection, until `total` requests or `duration_s` seconds, whichever
    comes first (at least one must be set). http.client rather than a richer client
    library: on a small machine the client shares the CPU with the server, and a lean
    client takes the least of it."""
    check_local(url)
    if total is None and duration_s is None:
        raise ValueError("bound the load: give total, duration_s or both")
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    result = LoadResult()
    lock = threading.Lock()
    issued = [0]

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)

    def post(conn: http.client.HTTPConnection, n: int) -> int:
        conn.request("POST", target, body=body(n) if callable(body) else body, headers=headers)
        r = conn.getresponse()
        r.read()
        return r.status

    conn = connect()
    for i in range(warmup):
        post(conn, i)
    conn.close()
    t0 = time.perf_counter()
    stop_at = t0 + duration_s if duration_s is not None else float("inf")

    def worker() -> None:
        conn = connect()
        while time.perf_counter() < stop_at:
            with lock:
                if total is not None and issued[0] >= total:
                    break
                n = issued[0]
                issued[0] += 1
            t = time.perf_counter()
            try:
                status = post(conn, n)
            except (OSError, http.client.HTTPException):
                with lock:
                    result.errors += 1
                conn.close()
                conn = connect()
                continue
            with lock:
                result.statuses[status] = result.statuses.get(status, 0) + 1
                if status < 400:
                    result.latencies_s.append(time.perf_counter() - t)
        conn.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    result.elapsed_s = time.perf_counter() - t0
    return result


async def run_load(*args, **kwargs) -> LoadResult:
    """run_load_sync off the event loop, so that several loads can run side by side."""
    return await asyncio.to_thread(run_load_sync, *args, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description="bounded load against a local onecard service")
    ap.add_argument("url", help="e.g. http://127.0.0.1:7862/api/v1/facedetect")
    ap.add_argument("image", help="an image file to send")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--duration", type=float, default=60.0, help="stop after this many seconds")
    args = ap.parse_args()
    data = Path(args.image).read_bytes()
    ctype = "image/png" if data[:4] == b"\x89PNG" else "image/jpeg"
    res = asyncio.run(run_load(args.url, data, {"content-type": ctype}, args.concurrency,
                               total=args.requests, duration_s=args.duration))
    print(json.dumps(res.summary(), indent=2))
    return 0 if res.errors == 0 and set(res.statuses) <= {200} else 1


if __name__ == "__main__":
    sys.exit(main())

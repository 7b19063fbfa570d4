"""The thread plan under a shared CPU: diffusers on CPU beside a busy neighbour (issue 10).

Each configuration runs in its own process (OpenMP reads its settings once, at load):
the time of one 40-step generation at 64x64 with the tiny random pipeline, alone and
while NEIGHBOURS busy-loop processes compete for the same cores. Configurations: the
thread count (1, or every core) and the wait policy (onecard's passive waits, or the
libraries' defaults, or OpenMP spinning).

    .venv/bin/python -m bench.contention_bench [--runs 5]

What matters is the ratio neighbour/alone: a plan that holds up slows down by about the
share of the CPU the neighbour takes, not 10-20x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, table, write_result

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from PIL import Image
import onecard
from services.runtime.device.threads import apply_threads
from services.img2img.params import Img2ImgItem
from services.img2img.progress import Progress
from services.img2img.sd import DiffusersBackend
from services.img2img.settings import Img2ImgSettings
threads = int(os.environ["ONECARD_SERVICE_THREADS"])
b = DiffusersBackend(Img2ImgSettings(backend="diffusers", model_path={model!r}, max_side={side}, scheduler="ddim"),
                     Progress())
b.load(onecard.Setup("img2img", b.settings, threads))
apply_threads(threads)
src = Image.fromarray(np.random.default_rng(0).integers(0, 255, ({side}, {side}, 3), dtype=np.uint8))
def one(seed):
    it = Img2ImgItem(src, "a cat", "", 1.0, {steps}, 7.5, seed, ({side}, {side})); b.prepare(it); b.infer_batch([it])
one(0)
times = []
for i in range({runs}):
    t = time.perf_counter(); one(i); times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

POLICIES = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "GOMP_SPINCOUNT": "0"},
    "short spin 1k": {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"},
    "short spin 20k": {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "1"},
    "library default": {},
    "spinning": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "infinite"},
}


def neighbours(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(model: Path, threads: int, policy: dict, runs: int, busy: int, side: int = 64, steps: int = 40) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")}
    env.update(policy)
    env.update({"ONECARD_SERVICE_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
                "MKL_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)})
    hogs = neighbours(busy)
    try:
        code = WORKER.format(root=str(ROOT), model=str(model), runs=runs, side=side, steps=steps)
        out = subprocess.run([sys.executable, "-c", code],
                             env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--neighbours", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only-threads", type=int, default=0)
    ap.add_argument("--only-policy", nargs="*")
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from tests.models import tiny_sd_img2img
    model = tiny_sd_img2img(Path(tempfile.mkdtemp(prefix="onecard-contention-")) / "tiny-sd")
    cores = os.cpu_count() or 2
    rows, doc = [], {"cores": cores, "neighbours": args.neighbours, "runs": args.runs, "side": args.side,
                     "steps": args.steps, "results": []}
    for threads in sorted({1, cores}) if not args.only_threads else [args.only_threads]:
        for name, policy in POLICIES.items():
            if args.only_policy and name not in args.only_policy:
                continue
            alone = measure(model, threads, policy, args.runs, 0, args.side, args.steps)
            busy = measure(model, threads, policy, args.runs, args.neighbours, args.side, args.steps)
            doc["results"].append({"threads": threads, "policy": name, "alone_s": round(alone, 3),
                                   "with_neighbours_s": round(busy, 3), "slowdown": round(busy / alone, 2)})
            rows.append((threads, name, f"{alone:.3f}", f"{busy:.3f}", f"{busy / alone:.2f}x"))
            print(rows[-1], flush=True)
    print(table(rows, ("threads", "wait policy", "alone s", f"{args.neighbours} neighbours s", "slowdown")))
    print("written:", write_result("contention", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The whole benchmark suite in one command: a table on stdout, JSON in bench/results/.

    .venv/bin/python -m bench.run_all            # full run (about 15 minutes on 2 cores)
    .venv/bin/python -m bench.run_all --quick    # shorter windows, for a smoke check

Each benchmark runs its baseline side by side in the same run: the bare backend
in-process, and the naive single-process design (both routes behind one executor).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.common import RESULTS, ROOT, table, write_result
from bench.tables import headline_rows

STEPS = {
    "supervisor": (["bench.supervisor_bench"], ["--trials", "50", "--idle-s", "30"],
                   ["--trials", "10", "--idle-s", "10"]),
    "ready": (["bench.ready_bench"], ["--trials", "3"], ["--trials", "1"]),
    "detect": (["bench.detect_bench"], ["--duration", "12"], ["--duration", "4"]),
    "isolation": (["bench.isolation_bench"], ["--duration", "20"], ["--duration", "6"]),
    "img2img": (["bench.img2img_bench"], ["--duration", "12"], ["--duration", "4"]),
    "contention": (["bench.contention_bench"], ["--runs", "5"], ["--runs", "2", "--only-threads", "2"]),
    "soak": (["bench.soak"], ["--requests", "10000"], ["--requests", "1000", "--warmup", "200"]),
}


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", choices=sorted(STEPS))
    args = ap.parse_args()
    codes = {}
    for name, (module, full, quick) in STEPS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.monotonic()
        print(f"== {name}", flush=True)
        codes[name] = subprocess.run([sys.executable, "-m", *module, *(quick if args.quick else full)],
                                     cwd=ROOT).returncode
        print(f"== {name}: exit {codes[name]} in {time.monotonic() - t0:.0f} s", flush=True)
    r = {n: load(n) for n in STEPS if (RESULTS / f"{n}.json").exists()}
    rows = headline_rows(r)
    print()
    print(table(rows, ("measure", "figure", "detail", "target")))
    path = write_result("all", {"exit_codes": codes, "results": r})
    print(f"written: {path}")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

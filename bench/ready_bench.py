"""Time to ready: the supervisor with configs/default.toml until every service is ready,
against the bare model load plus the same warm-up, both services started side by side
in fresh interpreters (the bare baseline has no HTTP server and no supervisor).

    .venv/bin/python -m bench.ready_bench [--trials 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, table, write_result
from tests.harness import SupervisorRun, free_port

BARE = {
    "detect": "from services.detect.backends import CenterFaceBackend as B; "
              "from services.detect.settings import DetectSettings as S",
    "img2img": "from services.img2img.style import StyleBackend as B0; "
               "from services.img2img.settings import Img2ImgSettings as S; "
               "from services.img2img.progress import Progress; B = lambda s: B0(s, Progress())",
}


def bare_once() -> float:
    code = ("import time, sys; t0 = time.perf_counter(); import onecard; {imp}; s = S(); b = B(s); "
            "b.load(onecard.Setup('bare', s, 1)); "
            "items = b.warmup_items(); [b.infer_batch(items) for _ in range(s.warmup_runs)]")
    env_threads = {"ONECARD_SERVICE_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    import os
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code.format(imp=imp)], cwd=ROOT, env={**os.environ, **env_threads})
             for imp in BARE.values()]
    for p in procs:
        assert p.wait(timeout=300) == 0
    return time.perf_counter() - t0


def served_once() -> float:
    tmp = Path(tempfile.mkdtemp(prefix="onecard-ready-"))
    run = SupervisorRun(tmp, {})
    run.config = ROOT / "configs" / "default.toml"
    run.extra_args = ["--set", f"supervisor.health_port={run.health_port}",
                      "--set", f'supervisor.control_socket="{run.socket}"',
                      "--set", f"services.detect.port={free_port()}", "--set", f"services.img2img.port={free_port()}",
                      "--set", "services.detect.threads=1", "--set", "services.img2img.threads=1"]
    t0 = time.perf_counter()
    with run:  # starts it
        run.wait_ready(timeout=300)
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    bare, served = [], []
    for _ in range(args.trials):  # interleaved: both see the same machine state
        bare.append(bare_once())
        served.append(served_once())
    doc = {"trials": args.trials, "bare_s": bare, "served_s": served,
           "bare_median_s": statistics.median(bare), "served_median_s": statistics.median(served),
           "ratio": statistics.median(served) / statistics.median(bare)}
    path = write_result("ready", doc)
    print(table([("bare load + warm-up (both, in parallel)", f"{doc['bare_median_s']:.2f} s"),
                 ("onecard run until every service is ready", f"{doc['served_median_s']:.2f} s"),
                 ("ratio", f"{doc['ratio']:.2f}")], ("measure", "median")))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

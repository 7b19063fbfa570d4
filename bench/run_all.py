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
    rows = []
    if "detect" in r:
        d = r["detect"]
        for batch in ("1", "8"):
            for c in ("1", "8", "32"):
                s = d["served"][batch][c]
                rows.append((f"detect throughput, batch {batch}, concurrency {c}", f"{s['throughput_rps']:.1f} rps",
                             f"p50 {s['p50_ms']} / p95 {s['p95_ms']} / p99 {s['p99_ms']} ms", ""))
        rows.append(("detect served/bare throughput at concurrency 32, batching on",
                     f"{d['ratio_c32_batching']:.2f}", "", ">= 0.9"))
        rows.append(("detect served/bare throughput at concurrency 32, batching off",
                     f"{d['ratio_c32_no_batching']:.2f}", "", ">= 0.9"))
        o = d["overhead_c1"]
        rows.append(("serving overhead at concurrency 1 (served p50 - bare p50)", f"{o['difference_p50_ms']:.2f} ms",
                     f"outside decode+inference p50 {o['outside_model_p50_ms']:.2f} ms", "<= 2 ms"))
    if "isolation" in r:
        i = r["isolation"]
        rows.append(("detect p99 under saturated img2img / alone", f"{i['detect_p99_loaded_over_alone']:.2f}",
                     f"{i['onecard']['loaded']['detect']['p99_ms']} vs {i['onecard']['alone']['detect']['p99_ms']} ms",
                     "<= 1.5"))
        rows.append(("naive design detect p99 / onecard (img2img saturated)",
                     f"{i['naive_p99_over_onecard_p99_loaded']:.1f}x",
                     f"naive {i['naive']['loaded']['detect']['p99_ms']} ms", ">= 5x"))
        rows.append(("img2img served/bare throughput", f"{i['img2img_throughput']['ratio']:.2f}", "", ">= 0.95"))
    if "img2img" in r:
        g = r["img2img"]
        for c, v in g["by_concurrency"].items():
            h = v["healthz"]
            rows.append((f"img2img ({g['mode']}) served/bare batched throughput, concurrency {c}",
                         f"{v['served_over_bare']:.2f}",
                         f"{v['served_images_per_s']} vs {v['bare_images_per_s']} img/s (bare batch {v['bare_batch']})",
                         ">= 0.9 at 8 (GPU)"))
            rows.append((f"/healthz p50 / p99 under img2img concurrency {c}",
                         f"{h['public_p50_ms']} / {h['public_p99_ms']} ms",
                         f"probe socket {h['probe_p50_ms']} / {h['probe_p99_ms']} ms", "p99 <= 20 ms"))
    if "contention" in r:
        for v in r["contention"]["results"]:
            rows.append((f"diffusers CPU, {v['threads']} threads, {v['policy']}: neighbours / alone",
                         f"{v['slowdown']:.2f}x", f"{v['with_neighbours_s']} vs {v['alone_s']} s", ""))
    if "ready" in r:
        rows.append(("time to ready / bare load + warm-up", f"{r['ready']['ratio']:.2f}",
                     f"{r['ready']['served_median_s']:.2f} s vs {r['ready']['bare_median_s']:.2f} s", ""))
    if "supervisor" in r:
        s = r["supervisor"]
        rows.append(("death detection median / p99",
                     f"{s['detection_ms']['median']:.1f} / {s['detection_ms']['p99']:.1f} ms",
                     f"{s['detection_ms']['trials']} trials", "median <= 50 ms"))
        rows.append(("onecard status wall time, median", f"{s['status_wall_s']['median']:.3f} s", "", "<= 0.3 s"))
        rows.append(("supervisor idle CPU", f"{s['idle_cpu_percent_of_core']:.3f} % of a core",
                     f"over {s['idle_window_s']:g} s", "<= 0.2 %"))
        rows.append(("supervisor RSS", f"{s['supervisor_rss_mb']:.1f} MB", "", "<= 60 MB"))
    if "soak" in r:
        k = r["soak"]
        worst = max(k["rss_growth"].values())
        rows.append((f"soak: {k['requests']} requests, errors", str(k["errors"]), f"{k['elapsed_s']:.0f} s", "0"))
        rows.append(("soak: largest RSS growth after warm-up", f"{100 * worst:+.2f}%",
                     ", ".join(f"{n} {100 * g:+.1f}%" for n, g in k["rss_growth"].items()), "<= 5 %"))
    print()
    print(table(rows, ("measure", "figure", "detail", "target")))
    path = write_result("all", {"exit_codes": codes, "results": r})
    print(f"written: {path}")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

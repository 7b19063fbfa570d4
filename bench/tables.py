"""The benchmarks' figures as markdown tables, written from their result files.

    .venv/bin/python -m bench.run_all                     # writes bench/results/*.json (not committed)
    .venv/bin/python -m bench.tables --publish detect soak  # copies those into bench/published/ and rewrites
    .venv/bin/python -m bench.tables                      # rewrites the pages from bench/published/
    .venv/bin/python -m bench.tables --check              # exit 1 when a page is stale

bench/published/ holds the result files the documentation quotes (committed: the figures are
never copied by hand). From them this writes docs/bench-figures.md (every table) and the
headline block of README.md between its bench-headline markers; --publish also redraws
docs/img/ with bench.plots. tests/unit/test_docs_site.py fails when either page differs from
what this writes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PUBLISHED = ROOT / "bench" / "published"
PAGE = ROOT / "docs" / "bench-figures.md"
README = ROOT / "README.md"
BEGIN = "<!-- bench-headline: written by `python -m bench.tables` from bench/published/ -->"
END = "<!-- /bench-headline -->"
NAMES = ("supervisor", "ready", "detect", "isolation", "img2img", "contention", "soak", "jobs", "batching",
         "img2img-gpu", "isolation-gpu", "batching-openloop")
GPU_NAMES = ("img2img-gpu", "isolation-gpu")


def load(directory: Path) -> dict[str, dict]:
    return {n: json.loads((directory / f"{n}.json").read_text()) for n in NAMES
            if (directory / f"{n}.json").exists()}


def markdown(rows: list[tuple], header: tuple) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def headline_rows(r: dict[str, dict]) -> list[tuple]:
    """(measure, figure, detail, target) for every result present: the table run_all prints."""
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
    if "img2img-gpu" in r:
        g = r["img2img-gpu"]
        for c, v in g["by_concurrency"].items():
            rows.append((f"GPU: img2img served/bare batched throughput, concurrency {c}",
                         f"{v['served_over_bare']:.2f}",
                         f"{v['served_images_per_s']} vs {v['bare_images_per_s']} img/s, served mean batch "
                         f"{_mean_batch(v)} (bare {v['bare_batch']}); /healthz p99 "
                         f"{v['healthz']['public_p99_ms']} ms", ">= 0.9 at 8"))
    if "isolation-gpu" in r:
        for sharing, ratio in r["isolation-gpu"]["detect_p99_loaded_over_alone"].items():
            run = r["isolation-gpu"]["runs"][sharing]
            loaded, alone = run["loaded"]["detect"]["p99_ms"], run["alone"]["detect"]["p99_ms"]
            rows.append((f"GPU: detect p99 beside saturated img2img / alone, {sharing.replace('_', '-')}",
                         f"{ratio:.2f}", f"{loaded} vs {alone} ms",
                         "<= 1.5"))
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
        gone = s["supervisor_gone_after_death_ms"]
        rows.append(("supervisor gone after a child's death, median / p99",
                     f"{gone['median']:.0f} / {gone['p99']:.0f} ms", "", "<= 1 s"))
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
    return rows


HEADLINE = ("detect served/bare throughput at concurrency 32, batching on", "serving overhead at concurrency 1",
            "detect p99 under saturated img2img / alone", "naive design detect p99", "death detection median / p99",
            "supervisor gone after", "/healthz p50 / p99 under img2img concurrency 8",
            "onecard status wall time, median", "supervisor idle CPU", "supervisor RSS", "soak: ",
            "GPU: img2img served/bare batched throughput, concurrency 8", "GPU: detect p99")


def _source(name: str, doc: dict) -> str:
    machine = doc.get("machine", {})
    gpu = f", {doc['gpu']}" if doc.get("gpu") else ""
    return (f"From `bench/published/{name}.json`: written {doc.get('when', '?')} on {machine.get('cpus', '?')} "
            f"CPUs{gpu}, Python {machine.get('python', '?')}.")


def _mean_batch(v: dict) -> str:
    """The served mean batch; "-" when the service made no call in that run (all failed)."""
    return "-" if v.get("served_mean_batch") is None else f"{v['served_mean_batch']:.2f}"


def gpu_tables(r: dict[str, dict]) -> list[str]:
    out: list[str] = []
    if "img2img-gpu" in r:
        g = r["img2img-gpu"]
        rows = [(c, v["bare_batch"], v["bare_images_per_s"], v["served_images_per_s"], f"{v['served_over_bare']:.2f}",
                 _mean_batch(v), f"{v['healthz']['public_p50_ms']} / {v['healthz']['public_p99_ms']}")
                for c, v in g["by_concurrency"].items()]
        out += [f"img2img served against the bare pipeline ({g.get('gpu', 'GPU')}; SD-1.5 architecture, fp16, "
                f"{g['side']}x{g['side']}, {g['steps']} steps at strength {g['strength']}):", "",
                markdown(rows, ("clients", "bare batch", "bare img/s", "served img/s", "served / bare",
                                "served mean batch", "/healthz p50 / p99 ms")), ""]
    if "isolation-gpu" in r:
        i = r["isolation-gpu"]
        rows = []
        for sharing, run in i["runs"].items():
            for which in ("alone", "loaded"):
                d = run[which]["detect"]
                rows.append((sharing.replace("_", "-"), "alone" if which == "alone" else "img2img saturated",
                             d["p50_ms"], d["p95_ms"], d["p99_ms"], d["throughput_rps"],
                             run[which].get("img2img", {}).get("throughput_rps", "-")))
        out += [f"CenterFace on onnxruntime's CUDA provider beside SD-1.5 img2img ({i['img2img_concurrency']} "
                f"clients), one card ({i.get('gpu', 'GPU')}), time-sliced and under MPS:", "",
                markdown(rows, ("sharing", "detect", "p50 ms", "p95 ms", "p99 ms", "detect rps", "img2img img/s")), ""]
    return out


def detect_table(d: dict) -> str:
    def level(batch: str, c: str) -> str:
        s = d["served"][batch].get(c)
        return f"{s['throughput_rps']:.1f}; {s['p50_ms']:.0f} / {s['p99_ms']:.0f}" if s else ""
    bare = d.get("bare", {})
    rows = [("bare backend, batch 1", f"{bare['1']['throughput_rps']:.1f}" if "1" in bare else "", "", ""),
            ("served, batching off", level("1", "1"), level("1", "8"), level("1", "32")),
            ("bare backend, batch 8", "", "", f"{bare['8']['throughput_rps']:.1f}" if "8" in bare else ""),
            ("served, batching on (8)", level("8", "1"), level("8", "8"), level("8", "32"))]
    return markdown(rows, ("requests/s; p50 / p99 ms", "concurrency 1", "concurrency 8", "concurrency 32"))


def jobs_tables(j: dict) -> str:
    over = [(o["workload"], o["queue"], f"{o['direct_p50_ms']:.2f} ms", f"{o['job_p50_ms']:.2f} ms",
             f"{o['added_p50_ms']:.2f} ms", f"{o['job_p99_ms']:.2f} ms") for o in j["overhead"]]
    units = sorted({s["units"] for s in j["throughput"]})
    by = {(s["workload"], s["units"]): s for s in j["throughput"]}
    scale = []
    for workload in dict.fromkeys(s["workload"] for s in j["throughput"]):
        base = by[(workload, units[0])]["jobs_per_s"]
        scale.append((f"{workload}, jobs/s (ratio to {units[0]} unit)",
                      *(f"{by[(workload, n)]['jobs_per_s']:.1f} ({by[(workload, n)]['jobs_per_s'] / base:.2f})"
                        if (workload, n) in by else "" for n in units)))
    return (markdown(over, ("workload", "queue", "direct p50", "job p50", "added p50", "job p99")) + "\n\n"
            + markdown(scale, ("workload", *(f"{n} unit{'s' if n > 1 else ''}" for n in units))))


def batching_table(b: dict) -> str:
    rows = [(r["profile"], r["policy"], r["clients"], f"{r['served_over_ideal']:.2f}", f"{r['p50_ms']:.0f}",
             f"{r['p99_ms']:.0f}") for r in sorted(b["rows"], key=lambda r: (r["profile"], r["policy"], r["clients"]))]
    return markdown(rows, ("profile", "policy", "clients", "served / ideal", "p50 ms", "p99 ms"))


def openloop_table(b: dict) -> str:
    rows = [(x["profile"], x["pattern"], x["rate"], x["policy"], f"{x['mean_ms']:.0f}", f"{x['p50_ms']:.0f}",
             f"{x['p99_ms']:.0f}", x["mean_batch"], x["failed"]) for x in b["rows"]]
    return markdown(rows, ("profile", "arrivals", "per s", "policy", "mean ms", "p50 ms", "p99 ms", "mean batch",
                           "failed"))


def render_page(r: dict[str, dict]) -> str:
    out = ["# Benchmark figures", "",
           "<!-- Written by `python -m bench.tables` from bench/published/; do not edit by hand. -->", "",
           "Every figure on this page is read from a result file the benchmarks wrote, committed under "
           "`bench/published/`; how they are run, what each compares and how to read them: "
           "[benchmarks.md](benchmarks.md).", ""]
    if not r:
        out += ["No result file is published yet: run the benchmarks and `python -m bench.tables --publish`.", ""]
    sources = [f"- {_source(n, doc)}" for n, doc in r.items()]
    rows = headline_rows(r)
    if rows:
        out += ["## Every measure", "", markdown(rows, ("measure", "figure", "detail", "target")), ""]
    if "detect" in r:
        out += ["## Face detection: throughput and latency", "", detect_table(r["detect"]), ""]
    if "jobs" in r:
        out += ["## Jobs API: what a job adds, and units on one Redis", "", jobs_tables(r["jobs"]), ""]
    if "batching" in r:
        out += ["## Batching against a simulated accelerator", "", batching_table(r["batching"]), ""]
    if "batching-openloop" in r:
        out += ["## Batching under open-loop and bursty arrivals", "",
                f"Poisson arrivals at a rate, or bursts of {r['batching-openloop'].get('burst', '?')}, "
                f"{r['batching-openloop'].get('duration_s', '?')} s each (`bench/batching_openloop.py`):", "",
                openloop_table(r["batching-openloop"]), ""]
    gpu = gpu_tables(r)
    if gpu:
        out += ["## On a GPU", "", *gpu]
    if sources:
        out += ["## Sources", "", *sources, ""]
    return "\n".join(out).rstrip("\n") + "\n"


def batching_summary(b: dict) -> str:
    """Served / ideal by clients, one row per profile and policy (p50 at 8 clients beside it):
    the default policy side by side with the fixed fill windows."""
    by = {(x["profile"], x["policy"], x["clients"]): x for x in b["rows"]}
    clients = sorted({x["clients"] for x in b["rows"]})
    rows = []
    for profile in dict.fromkeys(x["profile"] for x in b["rows"]):
        for policy in ("auto", "fixed-0", "fixed-150", "off"):
            got = [by.get((profile, policy, c)) for c in clients]
            if not any(got):
                continue
            eight = by.get((profile, policy, 8))
            rows.append((profile, policy, *(f"{g['served_over_ideal']:.2f}" if g else "" for g in got),
                         f"{eight['p50_ms']:.0f}" if eight else ""))
    return markdown(rows, ("profile", "policy", *(f"{c} clients" for c in clients), "p50 ms at 8"))


def render_headline(r: dict[str, dict]) -> str:
    rows = [row for row in headline_rows(r) if row[0].startswith(HEADLINE)]
    cpu_docs = [doc for n, doc in r.items() if n not in GPU_NAMES]
    when = sorted({doc["when"][:10] for doc in cpu_docs if "when" in doc}) or ["?"]
    cpus = sorted({str(doc["machine"]["cpus"]) for doc in cpu_docs if "machine" in doc}) or ["?"]
    gpus = sorted({f"{doc.get('gpu', 'GPU')}, {doc['when'][:10]}" for n, doc in r.items()
                   if n in GPU_NAMES and "when" in doc})
    lines = [BEGIN]
    if rows:
        lines += [markdown([(m, f, t) for m, f, _, t in rows], ("measure", "figure", "target")), "",
                  f"Measured {' to '.join(dict.fromkeys([when[0], when[-1]]))} on {'/'.join(cpus)} CPUs without a GPU "
                  + (f"except the rows marked GPU ({'; '.join(gpus)}) " if gpus else "")
                  + "(the targets are meant for a GPU host; how the runs were made and how to read them: "
                  "[docs/benchmarks.md](docs/benchmarks.md)); every figure and its source file: "
                  "[docs/bench-figures.md](docs/bench-figures.md)."]
    else:
        lines += ["No benchmark result is published yet ([docs/benchmarks.md](docs/benchmarks.md))."]
    if "batching" in r:
        b = r["batching"]
        lines += ["", f"Batching against the simulated accelerator (`bench/simaccel.py`; served / ideal, closed-loop "
                      f"clients, {b.get('duration_s', '?')} s a level, {b['when'][:10]}; the policies in "
                      "[docs/batching.md](docs/batching.md)):", "", batching_summary(b)]
    return "\n".join([*lines, END])


def readme_with(text: str, block: str) -> str:
    head, sep, rest = text.partition(BEGIN)
    if not sep or END not in rest:
        raise SystemExit(f"README.md has no {BEGIN!r} ... {END!r} block")
    return head + block + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--publish", nargs="*", choices=NAMES, metavar="NAME",
                    help="copy bench/results/NAME.json into bench/published/ first (no NAME: every one there)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    args = ap.parse_args(argv)
    if args.publish is not None:
        names = args.publish or [n for n in NAMES if (RESULTS / f"{n}.json").exists()]
        PUBLISHED.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(RESULTS / f"{name}.json", PUBLISHED / f"{name}.json")
            print(f"published bench/results/{name}.json")
        from bench import plots
        if any(n in plots.PLOTS for n in names):
            plots.main(["--results", str(PUBLISHED)])
    r = load(PUBLISHED)
    page, readme = render_page(r), readme_with(README.read_text(), render_headline(r))
    if args.check:
        stale = [p.name for p, text in ((PAGE, page), (README, readme)) if p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run .venv/bin/python -m bench.tables", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    README.write_text(readme)
    print(f"wrote {PAGE.relative_to(ROOT)} and the headline block of README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

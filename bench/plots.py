"""The benchmarks' figures as pictures: bench/results/*.json -> PNGs (docs/img/ by default).

    .venv/bin/python -m bench.batching_bench --duration 10   # writes bench/results/batching.json
    .venv/bin/python -m bench.plots                          # writes docs/img/*.png

What it draws, from the result files that exist (the others are skipped):
  batching.json  batching-served-over-ideal.png  served / ideal against clients, per policy
                 batching-latency.png            p50 and p99 against clients, per policy
                 batching-batch-size.png         items per model call against clients, per policy
  detect.json    detect-latency.png              p50 and p99 against concurrency, batching off and on
                 detect-throughput.png           served and bare throughput against concurrency

Needs matplotlib (`pip install -e ".[bench]"`; the test extra has it too); the services never do.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "img"
# bench.batching_bench sends one warm-up request per level (loadgen's warmup=1): its model
# call is in the level's call count
BATCHING_WARMUP = 1
POLICY_STYLE = {"auto": ("tab:blue", "o"), "fixed-0": ("tab:orange", "s"), "fixed-150": ("tab:green", "^"),
                "off": ("tab:gray", "x")}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _subplots(plt, n: int, title: str):
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat[:n])


def _save(plt, fig, out: Path, note: str) -> Path:
    fig.text(0.01, 0.005, note, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return out


def _clients_axis(ax, levels: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("closed-loop clients")
    ax.grid(True, alpha=0.3)


def _by_profile(doc: dict) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {}
    for row in doc["rows"]:
        out.setdefault(row["profile"], {}).setdefault(row["policy"], []).append(row)
    for policies in out.values():
        for rows in policies.values():
            rows.sort(key=lambda r: r["clients"])
    return out


def _note(doc: dict) -> str:
    machine = doc.get("machine", {})
    return (f"{doc.get('when', '?')}, {machine.get('cpus', '?')} CPUs, python {machine.get('python', '?')}, "
            f"{doc.get('duration_s', '?')} s per level")


def _batching_figure(plt, doc: dict, out: Path, title: str, ylabel: str,
                     draw: Callable[[Any, str, list[dict], str, str], None]) -> Path:
    profiles = _by_profile(doc)
    fig, axes = _subplots(plt, len(profiles), title)
    for ax, (profile, policies) in zip(axes, profiles.items(), strict=False):
        levels = sorted({r["clients"] for rows in policies.values() for r in rows})
        for policy, rows in policies.items():
            color, marker = POLICY_STYLE.get(policy, ("black", "."))
            draw(ax, policy, rows, color, marker)
        ax.set_title(profile)
        ax.set_ylabel(ylabel)
        _clients_axis(ax, levels)
        ax.legend(fontsize=8)
    return _save(plt, fig, out, _note(doc))


def batching(plt, doc: dict, out_dir: Path) -> list[Path]:
    def served(ax, policy, rows, color, marker):
        ax.plot([r["clients"] for r in rows], [r["served_over_ideal"] for r in rows], color=color, marker=marker,
                label=policy)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.9, color="black", linewidth=0.8, linestyle=":")
        ax.set_ylim(0, 1.1)

    def latency(ax, policy, rows, color, marker):
        xs = [r["clients"] for r in rows]
        ax.plot(xs, [r["p50_ms"] for r in rows], color=color, marker=marker, label=f"{policy} p50")
        ax.plot(xs, [r["p99_ms"] for r in rows], color=color, marker=marker, linestyle="--", alpha=0.6,
                label=f"{policy} p99")
        ax.set_yscale("log")

    def batch_size(ax, policy, rows, color, marker):
        xs, ys = [], []
        for r in rows:
            if r.get("calls"):
                xs.append(r["clients"])
                ys.append((sum(r["statuses"].values()) + BATCHING_WARMUP) / r["calls"])
        ax.plot(xs, ys, color=color, marker=marker, label=policy)
        ax.axhline(doc.get("max_batch_size", 8), color="black", linewidth=0.8, linestyle=":")

    return [
        _batching_figure(plt, doc, out_dir / "batching-served-over-ideal.png",
                         "Served / ideal throughput (dotted: the 0.9 goal)", "served / ideal", served),
        _batching_figure(plt, doc, out_dir / "batching-latency.png",
                         "Latency against load (solid p50, dashed p99)", "ms (log)", latency),
        _batching_figure(plt, doc, out_dir / "batching-batch-size.png",
                         "Items per model call (dotted: max_batch_size)", "items per call", batch_size),
    ]


def detect(plt, doc: dict, out_dir: Path) -> list[Path]:
    served = {int(b): {int(c): s for c, s in levels.items()} for b, levels in doc["served"].items()}
    note = _note(doc)
    fig, (ax,) = _subplots(plt, 1, "detect: latency against concurrency (solid p50, dashed p99)")
    for batch, color in zip(sorted(served), ("tab:gray", "tab:blue", "tab:green"), strict=False):
        levels = sorted(served[batch])
        ax.plot(levels, [served[batch][c]["p50_ms"] for c in levels], color=color, marker="o",
                label=f"max_batch_size {batch} p50")
        ax.plot(levels, [served[batch][c]["p99_ms"] for c in levels], color=color, marker="o", linestyle="--",
                alpha=0.6, label=f"max_batch_size {batch} p99")
    ax.set_ylabel("ms")
    _clients_axis(ax, sorted({c for b in served.values() for c in b}))
    ax.set_xlabel("concurrent clients")
    ax.legend(fontsize=8)
    paths = [_save(plt, fig, out_dir / "detect-latency.png", note)]

    fig, (ax,) = _subplots(plt, 1, "detect: served throughput against the bare backend")
    for batch, color in zip(sorted(served), ("tab:gray", "tab:blue", "tab:green"), strict=False):
        levels = sorted(served[batch])
        ax.plot(levels, [served[batch][c]["throughput_rps"] for c in levels], color=color, marker="o",
                label=f"served, max_batch_size {batch}")
        bare = doc.get("bare", {}).get(str(batch))
        if bare:
            ax.axhline(bare["throughput_rps"], color=color, linestyle=":", label=f"bare backend, batch {batch}")
    ax.set_ylabel("requests / s")
    ax.set_ylim(bottom=0)
    _clients_axis(ax, sorted({c for b in served.values() for c in b}))
    ax.set_xlabel("concurrent clients")
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, out_dir / "detect-throughput.png", note))
    return paths


PLOTS = {"batching": batching, "detect": detect}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the result files are")
    ap.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    args = ap.parse_args(argv)
    found = {name: args.results / f"{name}.json" for name in PLOTS if (args.results / f"{name}.json").exists()}
    if not found:
        print(f"no result file to plot in {args.results} ({', '.join(f'{n}.json' for n in PLOTS)}): run a "
              f"benchmark first, e.g. python -m bench.batching_bench", file=sys.stderr)
        return 1
    plt = _pyplot()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, path in found.items():
        for written in PLOTS[name](plt, json.loads(path.read_text()), args.out):
            print(f"{path.name} -> {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

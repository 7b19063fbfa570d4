"""bench/plots.py turns the benchmarks' result files into PNGs, and docs/benchmarks.md shows
the ones committed under docs/img/."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
from PIL import Image

from tests.harness import ROOT


def batching_doc() -> dict:
    rows = []
    for profile, a, b in (("sd15-h100", 0.643, 0.0644), ("linear", 0.2, 0.2)):
        for policy in ("auto", "fixed-0", "off"):
            for clients in ((1, 8) if policy == "off" else (1, 2, 4, 8)):
                ideal = min(clients, 8) / (a + b * (min(clients, 8) - 1))
                calls = 10
                rows.append({"profile": profile, "policy": policy, "clients": clients, "served_rps": ideal * 0.9,
                             "ideal_rps": ideal, "served_over_ideal": 0.9, "p50_ms": 700.0 * clients,
                             "p99_ms": 900.0 * clients, "errors": 0, "statuses": {"200": calls * clients - 1},
                             "calls": calls, "waited_s": 0.1})
    return {"machine": {"cpus": 2, "python": "3.11.7"}, "when": "2026-01-01T00:00:00", "duration_s": 5,
            "max_batch_size": 8, "rows": rows}


def detect_doc() -> dict:
    level = {"p50_ms": 10.0, "p99_ms": 20.0, "throughput_rps": 50.0}
    return {"machine": {"cpus": 2, "python": "3.11.7"}, "when": "2026-01-01T00:00:00", "duration_s": 4,
            "bare": {"1": {"throughput_rps": 55.0}, "8": {"throughput_rps": 60.0}},
            "served": {"1": {"1": level, "8": level, "32": level}, "8": {"1": level, "8": level, "32": level}}}


def plots(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.plots", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_each_result_file_becomes_its_pictures(tmp_path):
    results, out = tmp_path / "results", tmp_path / "img"
    results.mkdir()
    (results / "batching.json").write_text(json.dumps(batching_doc()))
    (results / "detect.json").write_text(json.dumps(detect_doc()))
    (results / "soak.json").write_text("{}")  # not one it draws: left alone
    done = plots("--results", str(results), "--out", str(out))
    assert done.returncode == 0, done.stderr
    names = {"batching-served-over-ideal.png", "batching-latency.png", "batching-batch-size.png",
             "detect-latency.png", "detect-throughput.png"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        img = Image.open(out / name)
        assert img.format == "PNG" and img.width >= 500 and img.height >= 350
        pixels = np.asarray(img.convert("RGB")).reshape(-1, 3)
        assert len(np.unique(pixels, axis=0)) > 20, f"{name} is blank"


def test_without_results_it_says_what_to_run(tmp_path):
    done = plots("--results", str(tmp_path), "--out", str(tmp_path / "img"))
    assert done.returncode == 1
    assert "run a benchmark first" in done.stderr and not (tmp_path / "img").exists()


def test_the_benchmarks_page_shows_the_committed_pictures():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = set(re.findall(r"!\[[^\]]*\]\(img/([^)]+\.png)\)", page))
    committed = {p.name for p in (ROOT / "docs" / "img").glob("*.png")}
    assert shown and shown == committed

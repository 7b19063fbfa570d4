"""The documentation site: it builds with `mkdocs build --strict` (no broken link or anchor),
every page is in its nav, the generated pages (the configuration reference, the benchmark
figures) are what their generators write from the code and the published result files, and
every path or module the docs name exists."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.harness import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _gen_config():
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def _pages() -> list[str]:
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))


def _nav_pages(nav) -> list[str]:
    out = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


# --- the site ----------------------------------------------------------------------------------

def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_every_page_is_in_the_nav_once():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == _pages(), "a page missing from mkdocs.yml's nav, or a nav entry without its page"
    assert len(nav) == len(set(nav))


def test_the_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "the README is the front page: details belong under docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        if not link.startswith(("http://", "https://")):
            assert (ROOT / link).exists(), link


# --- generated pages ---------------------------------------------------------------------------

def test_the_configuration_reference_is_the_settings_classes():
    assert (DOCS / "configuration.md").read_text() == _gen_config().render(), \
        "docs/configuration.md is stale: run .venv/bin/python docs/gen_config.py"


def test_the_configuration_reference_lists_every_key_with_its_default_and_bounds():
    from services.jobs.settings import QueueSettings
    from services.runtime.pipeline.settings import ModelServiceSettings
    from supervisor.config.settings import SupervisorSettings
    page = (DOCS / "configuration.md").read_text()
    for name in [*ModelServiceSettings.model_fields, *QueueSettings.model_fields,
                 *SupervisorSettings.__dataclass_fields__]:
        assert f"| `{name}` |" in page, name
    assert "| `grace_s` | number | `10` | > 0, ≤ 3600 | SIGTERM to SIGKILL wait |" in page
    assert "| `max_body_bytes` | integer | `20 MiB` | ≥ 1 KiB, ≤ 2 GiB |" in page
    assert "| `max_body_bytes` | integer | `28 MiB` (instead of `20 MiB`) |" in page  # the jobs service's


def test_a_note_for_a_key_that_does_not_exist_stops_the_generator(monkeypatch):
    gen = _gen_config()
    monkeypatch.setitem(gen.NOTES, "supervisor.no_such_key", "a note")
    with pytest.raises(SystemExit, match="supervisor.no_such_key"):
        gen.render()


def test_the_benchmark_tables_are_the_published_result_files():
    from bench import tables
    published = tables.load(tables.PUBLISHED)
    assert (DOCS / "bench-figures.md").read_text() == tables.render_page(published), \
        "docs/bench-figures.md is stale: run .venv/bin/python -m bench.tables"
    assert README.read_text() == tables.readme_with(README.read_text(), tables.render_headline(published)), \
        "the README's headline figures are stale: run .venv/bin/python -m bench.tables"


def test_the_pictures_are_drawn_from_published_result_files():
    from bench import plots, tables
    pictures = [p.name for p in (DOCS / "img").glob("*.png")]
    assert pictures
    for picture in pictures:
        (source,) = [name for name in plots.PLOTS if picture.startswith(f"{name}-")]
        assert (tables.PUBLISHED / f"{source}.json").exists(), f"docs/img/{picture} has no published result file"


def test_the_tables_are_read_from_the_result_files(tmp_path):
    from bench import tables
    level = {"p50_ms": 10.0, "p95_ms": 15.0, "p99_ms": 20.0, "throughput_rps": 50.0}
    detect = {"machine": {"cpus": 3, "python": "3.11.7"}, "when": "2030-01-02T03:04:05",
              "bare": {"1": {"throughput_rps": 55.5}, "8": {"throughput_rps": 60.0}},
              "served": {b: {"1": level, "8": level, "32": {**level, "throughput_rps": 42.25}} for b in ("1", "8")},
              "ratio_c32_batching": 0.7, "ratio_c32_no_batching": 0.76,
              "overhead_c1": {"difference_p50_ms": 1.234, "outside_model_p50_ms": 0.5}}
    (tmp_path / "detect.json").write_text(json.dumps(detect))
    r = tables.load(tmp_path)
    page, block = tables.render_page(r), tables.render_headline(r)
    assert "| bare backend, batch 1 | 55.5 |" in page and " 42.2; 10 / 20 |" in page
    assert "2030-01-02T03:04:05 on 3 CPUs" in page
    assert "| detect served/bare throughput at concurrency 32, batching on | 0.70 | >= 0.9 |" in block
    assert "| serving overhead at concurrency 1 (served p50 - bare p50) | 1.23 ms | <= 2 ms |" in block
    assert "Measured 2030-01-02 on 3 CPUs" in block


def test_a_gpu_run_whose_service_made_no_call_and_whose_card_nvml_did_not_name_still_renders(tmp_path):
    from bench import tables
    health = {"public_p50_ms": 1.0, "public_p99_ms": 2.0, "probe_p50_ms": 1.0, "probe_p99_ms": 2.0, "failures": 0}
    run = {"bare_images_per_s": 7.0, "bare_batch": 8, "served_images_per_s": 0.0, "served_over_bare": 0.0,
           "healthz": health, "served_calls": 0, "served_mean_batch": None, "waited_s": 0.0}
    doc = {"machine": {"cpus": 16, "python": "3.11.7"}, "when": "2030-01-02T03:04:05", "side": 512, "steps": 20,
           "strength": 0.75, "by_concurrency": {"8": run}}
    (tmp_path / "img2img-gpu.json").write_text(json.dumps(doc))
    r = tables.load(tmp_path)
    page, block = tables.render_page(r), tables.render_headline(r)
    assert "| 8 | 8 | 7.0 | 0.0 | 0.00 | - |" in page
    assert "(GPU, 2030-01-02)" in block
    assert any("served mean batch - (bare 8)" in row[2] for row in tables.headline_rows(r))


# --- what the docs name exists -----------------------------------------------------------------

TOP = ("supervisor", "services", "onecard", "common", "bench", "tests", "deploy", "configs", "packaging", "examples",
       "docs")
PATH_RE = re.compile(r"(?<![\w/.$<-])((?:" + "|".join(TOP) + r")/[\w./-]*\w)")
# a dotted name, not inside a TOML table header ([services.jobs.env]) or a key = value
MODULE_RE = re.compile(r"(?<![\w/.\[-])((?:supervisor|services|onecard|common|bench|tests)(?:\.[\w\u01c1]+)+)"
                       r"(?![\w\]=])")
GENERATED = ("bench/results", "bench/published")  # written by a run, not committed or not yet


def _module_file(parts: list[str]):
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(name: str, source: str) -> bool:
    mutant = re.fullmatch(r"x(?:\u01c1([^\u01c1]+)\u01c1|_)(\w+?)__mutmut_\w*", name)
    if mutant:  # mutmut's name of a mutant: x_function__mutmut_N or xǁClassǁmethod__mutmut_N
        cls, func = mutant.groups()
        return bool(re.search(rf"def {re.escape(func)}\b", source)) and (
            cls is None or bool(re.search(rf"class {re.escape(cls)}\b", source)))
    return bool(re.search(rf"^\s*(?:async def|def|class) {re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]|"
                          rf"import .*\b{re.escape(name)}\b", source, re.M))


def stale_names(text: str, page_dir=ROOT) -> list[str]:
    """Paths that do not exist (from the root, or from the page for a link), and dotted module
    names whose last part the module does not define."""
    stale = []
    for m in PATH_RE.finditer(text):
        path = m.group(1)
        if not (ROOT / path).exists() and not (page_dir / path).exists() and not path.startswith(GENERATED):
            stale.append(path)
    for m in MODULE_RE.finditer(text):
        parts = m.group(1).split(".")
        if _module_file(parts[:2]) is None:
            continue  # a config key such as supervisor.grace_s or services.NAME, not a module
        i = len(parts)
        while _module_file(parts[:i]) is None:
            i -= 1
        if i < len(parts) and not _defined(parts[i], _module_file(parts[:i]).read_text()):
            stale.append(m.group(1))
    return stale


def test_the_docs_name_only_paths_and_modules_that_exist():
    found = {str(p.relative_to(ROOT)): stale_names(p.read_text(), p.parent) for p in [README, *DOCS.rglob("*.md")]}
    assert {k: v for k, v in found.items() if v} == {}


def test_a_moved_module_is_caught():
    assert stale_names("see supervisor/lifecycle.py and `supervisor.config.x_load_config__mutmut_22`") == [
        "supervisor/lifecycle.py", "supervisor.config.x_load_config__mutmut_22"]
    assert stale_names("`supervisor.config.loading.x_load_config__mutmut_22`, supervisor/config/loading.py, "
                       "`services.runtime.pipeline.gpu_worker.x\u01c1GpuWorker\u01c1shutdown__mutmut_1`, "
                       "`[services.jobs.env]`, supervisor.grace_s") == []

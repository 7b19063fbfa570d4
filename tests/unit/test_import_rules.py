"""The import rules of pyproject.toml ([tool.importlinter]) hold: the supervisor's layers,
a pure policy, a lean long-running supervisor, a `common` package that stands alone, no
import cycles. And `common` needs nothing but the standard library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

from tests.harness import ROOT


def test_the_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout or "broken" not in r.stdout.split("Contracts:")[-1], r.stdout


def test_common_imports_only_the_standard_library():
    graph = grimp.build_graph("common", include_external_packages=True)
    external = {m for m in graph.modules if not m.startswith("common")}
    assert external <= set(sys.stdlib_module_names), sorted(external - set(sys.stdlib_module_names))

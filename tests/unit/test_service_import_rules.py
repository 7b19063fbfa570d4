"""The services' import rules (pyproject.toml, [tool.importlinter]): the runtime's layers
(serve > shell > pipeline > edge > codecs > device > settings > errors), codecs and the edge
free of what sits above them, no cycle in the runtime, the built-in model services and the
bench's simulated accelerator on the public API only, the jobs service on the shell alone.
A user's service (the OCR example, the SDK test service) imports onecard and nothing else of
this repository, and ``import onecard`` (with its settings) loads no web or ML library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT

USER_SERVICES = [ROOT / "examples/ocr/ocr_service", ROOT / "tests/children/sdk_app.py"]


def test_import_contracts_are_kept():
    # in a process of its own: import-linter changes the logging set-up of the process it runs in
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def _repository_imports(path: Path) -> set[str]:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    found = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            found |= {n.split(".")[0] for n in names}
    return found & {"services", "supervisor", "tests", "bench", "common"}


def test_user_services_import_only_onecard():
    for path in USER_SERVICES:
        assert _repository_imports(path) == set(), path


def test_importing_onecard_and_its_settings_stays_light():
    code = ("import sys, onecard\nfrom onecard import Settings, Model, Params, Float\n"
            "import ocr_service.settings\n"
            "print(sorted(m for m in ('fastapi', 'numpy', 'cv2', 'PIL', 'torch', 'onnxruntime', 'uvicorn')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": f"{ROOT}:{ROOT / 'examples/ocr'}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

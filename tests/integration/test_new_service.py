"""`onecard new-service NAME` writes a skeleton that works as written: its own test (which
starts the service as the supervisor would and sends a picture in each input form) passes,
and its config block names its factory. The command refuses a bad name or a used folder."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.harness import ROOT


def onecard(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_skeleton_passes_its_own_test(tmp_path):
    folder = tmp_path / "colors"
    out = onecard("new-service", "colors", "--dir", str(folder))
    assert out.returncode == 0, out.stderr
    written = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert written == {"colors_service/__init__.py", "colors_service/settings.py", "colors_service/app.py",
                       "tests/test_colors_service.py", "onecard.toml"}
    config = tomllib.loads((folder / "onecard.toml").read_text())
    assert config["services"]["colors"]["app"] == "colors_service.app:create_app"
    assert config["services"]["colors"]["env"]["PYTHONPATH"] == str(folder)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=folder,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout


def test_bad_names_and_used_folders_are_refused(tmp_path):
    out = onecard("new-service", "Bad-Name", "--dir", str(tmp_path / "x"))
    assert out.returncode == 2 and "lower-case letters" in out.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    out = onecard("new-service", "ok", "--dir", str(tmp_path / "used"))
    assert out.returncode == 2 and "not empty" in out.stderr
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"

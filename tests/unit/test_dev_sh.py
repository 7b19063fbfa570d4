"""dev.sh: the sample photo the README's try-it commands use, and its usage errors. The
environment build itself is what CI runs (.ci/run -> ./dev.sh test) on every clean clone."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
from PIL import Image

from tests.harness import ROOT
from tests.images import astronaut

DEV_SH = str(ROOT / "dev.sh")


def ready_venv(tmp_path):
    """A venv dev.sh takes as built: this interpreter behind bin/python and a fresh stamp."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / ".onecard-installed").touch()
    return venv


def dev_sh(args, venv, cwd):
    env = {**os.environ, "ONECARD_VENV": str(venv)}
    return subprocess.run([DEV_SH, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_sample_writes_the_astronaut_as_a_jpeg_relative_to_the_caller(tmp_path):
    venv = ready_venv(tmp_path)
    done = dev_sh(["sample", "photo.jpg"], venv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "photo.jpg"
    assert f"wrote {out}" in done.stderr
    img = Image.open(io.BytesIO(out.read_bytes()))
    assert img.format == "JPEG" and img.size == (512, 512) and img.mode == "RGB"
    diff = np.abs(np.asarray(img, dtype=np.int16) - astronaut().astype(np.int16))
    assert diff.mean() < 4  # the photo itself, through a quality-90 JPEG


def test_readme_try_it_commands_use_the_default_sample():
    readme = (ROOT / "README.md").read_text()
    default = re.search(r'^SAMPLE="([^"]+)"', (ROOT / "dev.sh").read_text(), re.M).group(1)
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "./dev.sh sample" in quick_start
    posts = [ln for ln in quick_start.splitlines() if ln.startswith("curl") and "--data-binary" in ln]
    assert posts and all(f"@{default}" in ln for ln in posts)
    assert default in (ROOT / ".gitignore").read_text().split()


def test_an_unknown_command_prints_usage_and_exits_2(tmp_path):
    done = dev_sh(["deploy"], ready_venv(tmp_path), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("usage: ./dev.sh run")

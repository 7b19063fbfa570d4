"""The `onecard` command line: `check` (its exit code, the plan it prints, secrets hidden),
the config every command finds wherever it runs, `status` and `stop` without typer
(supervisor/cli/quick.py: the same options, the rest to typer), the version, and a
supervisor that imports no ML library."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from supervisor.cli import quick as quickcli
from supervisor.cli.commands import app
from tests.config_files import BASE, write
from tests.harness import ROOT


def test_cli_check_exits_2_with_the_message(tmp_path):
    p = write(tmp_path, BASE.replace("port = 7861", "port = 7862"))
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(p)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "configuration error" in r.stderr and "already used" in r.stderr


def test_cli_check_prints_the_plan(tmp_path):
    p = write(tmp_path, BASE)
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(p),
                        "--set", "services.detect.threads=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "service detect  http://127.0.0.1:7862  threads 1" in out
    assert "command  " in out and "-m services.runtime.serve" in out
    assert "env  OMP_NUM_THREADS=1" in out and "env  CUDA_VISIBLE_DEVICES=0" in out
    assert "MPS off" in out and "usable CPUs" in out


def test_check_redacts_secrets(tmp_path):
    text = BASE + ('\n[services.detect.env]\nHF_TOKEN = "hf_secretvalue"\nREDIS_URL = "redis://u:pw1234@db:6379"\n'
                   'PLAIN = "visible"\n[services.detect.settings]\napi_key = "sk-topsecret"\n')
    p = write(tmp_path, text)
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(p)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for secret in ("hf_secretvalue", "pw1234", "sk-topsecret"):
        assert secret not in r.stdout + r.stderr
    assert "env  HF_TOKEN=<redacted>" in r.stdout and "redis://u:<redacted>@db:6379" in r.stdout
    assert "env  PLAIN=visible" in r.stdout and '"api_key": "<redacted>"' in r.stdout


def test_the_packaged_default_is_configs_default():
    import tomllib

    from supervisor.config.location import PACKAGED_DEFAULT
    assert tomllib.loads(PACKAGED_DEFAULT.read_text()) == tomllib.loads((ROOT / "configs" / "default.toml").read_text())


def test_config_resolution_is_the_same_for_every_command_and_independent_of_cwd(tmp_path):
    from supervisor.config.location import PACKAGED_DEFAULT, resolve
    assert resolve("x.toml", {"ONECARD_CONFIG": "/e.toml"}).path == "x.toml"
    assert resolve(None, {"ONECARD_CONFIG": "/e.toml"}).origin == "ONECARD_CONFIG"
    assert resolve(None, {}).path == str(PACKAGED_DEFAULT)
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    env.pop("ONECARD_CONFIG", None)
    r = subprocess.run([sys.executable, "-m", "supervisor", "check"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # a directory with no configs/ in it
    assert r.returncode == 0, r.stderr
    assert f"config  {PACKAGED_DEFAULT}: valid" in r.stdout
    r = subprocess.run([sys.executable, "-m", "supervisor", "check"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={**env, "ONECARD_CONFIG": str(tmp_path / "nope.toml")})
    assert r.returncode == 2 and f"ONECARD_CONFIG: {tmp_path / 'nope.toml'}: no such file" in r.stderr
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", "nope.toml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--config: nope.toml: no such file" in r.stderr
    r = subprocess.run([sys.executable, "-m", "supervisor", "check", "--set", "oops"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--set 'oops': expected key.path=value" in r.stderr


def test_version():
    from supervisor.version import __version__
    r = subprocess.run([sys.executable, "-m", "supervisor", "--version"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f"onecard {__version__} (Python ")


def test_supervisor_imports_no_ml_library():
    code = ("import sys; import supervisor.cli.commands, supervisor.driver.supervisor, supervisor.config.loading, "
            "supervisor.cli.status; "
            "from supervisor.config.loading import load_config; load_config('configs/default.toml'); "
            "bad = [m for m in ('torch', 'onnxruntime', 'cv2', 'diffusers', 'insightface', 'numpy') "
            "if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _options(command: str) -> set[str]:
    click_cmd = typer.main.get_command(app).commands[command]
    return {o for p in click_cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")} - {"--help"}


@pytest.mark.parametrize("command", ["status", "stop"])
def test_the_quick_parser_takes_exactly_the_typer_commands_options(command):
    quick = {o for a in quickcli.parser(command)._actions for o in a.option_strings}
    assert quick == _options(command)


@pytest.mark.parametrize("argv", [["status", "--help"], ["stop", "-h"], ["status", "--bogus"],
                                  ["status", "--interval", "often"], ["run"]])
def test_what_the_quick_parser_does_not_take_goes_to_typer(argv):
    assert quickcli.run(argv) is None


def test_status_through_the_quick_path_names_a_missing_socket_and_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervisor", "status", "--socket", str(tmp_path / "none.sock")],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "does not exist" in r.stderr
    imported = subprocess.run([sys.executable, "-X", "importtime", "-m", "supervisor", "status", "--socket",
                               str(tmp_path / "none.sock")], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert " typer" not in imported.stderr and "pydantic" not in imported.stderr

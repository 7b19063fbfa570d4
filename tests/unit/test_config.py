from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.config import ConfigError, load_config, parse_value
from tests.harness import ROOT

BASE = """
[supervisor]
grace_s = 5
[services.detect]
app = "services.detect.app:create_app"
port = 7862
[services.img2img]
app = "services.img2img.app:create_app"
port = 7861
"""


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, **kw)
    return str(ei.value)


def test_valid_config_and_defaults(tmp_path):
    cfg = load_config(write(tmp_path, BASE), environ={})
    assert cfg.supervisor.grace_s == 5
    assert cfg.supervisor.liveness_failures == 3
    assert cfg.services["detect"].port == 7862
    assert cfg.services["detect"].threads == "auto"


def test_unknown_key_names_file_and_key(tmp_path):
    p = write(tmp_path, BASE.replace("grace_s = 5", "grace_s = 5\ngrase = 1"))
    msg = error_of(p, environ={})
    assert f"{p}: supervisor.grase: unknown key" in msg


def test_wrong_type_says_what_was_expected(tmp_path):
    p = write(tmp_path, BASE.replace("port = 7862", 'port = "abc"'))
    msg = error_of(p, environ={})
    assert f"{p}: services.detect.port:" in msg and "integer" in msg and "'abc'" in msg


def test_out_of_range_port(tmp_path):
    msg = error_of(write(tmp_path, BASE.replace("port = 7862", "port = 70000")), environ={})
    assert "services.detect.port" in msg and "65535" in msg


def test_duplicate_ports(tmp_path):
    msg = error_of(write(tmp_path, BASE.replace("port = 7861", "port = 7862")), environ={})
    assert "services.img2img.port: port 7862 is already used by services.detect.port" in msg


def test_port_clash_with_probe_port(tmp_path):
    msg = error_of(write(tmp_path, BASE.replace("port = 7861", "port = 7860")), environ={})
    assert "already used by supervisor.health_port" in msg


def test_missing_model_path(tmp_path):
    text = BASE + '\n[services.detect.settings]\nmodel_path = "/nonexistent/model.onnx"\n'
    msg = error_of(write(tmp_path, text), environ={})
    assert "services.detect.settings.model_path: no such file or directory: /nonexistent/model.onnx" in msg


def test_app_and_command_are_exclusive(tmp_path):
    text = BASE.replace('port = 7862', 'port = 7862\ncommand = ["x"]')
    assert "exactly one of 'app' and 'command'" in error_of(write(tmp_path, text), environ={})


def test_bad_toml_and_missing_file(tmp_path):
    assert "not valid TOML" in error_of(write(tmp_path, "[supervisor\n"), environ={})
    assert "no such file" in error_of(tmp_path / "absent.toml", environ={})


def test_override_order_env_then_set(tmp_path):
    p = write(tmp_path, BASE)
    env = {"ONECARD_SERVICES__DETECT__PORT": "9000", "ONECARD_SUPERVISOR__GRACE_S": "7.5",
           "ONECARD_SERVICE_NAME": "ignored: a child's variable"}
    cfg = load_config(p, environ=env)
    assert cfg.services["detect"].port == 9000 and cfg.supervisor.grace_s == 7.5
    cfg = load_config(p, sets=["services.detect.port=9100"], environ=env)
    assert cfg.services["detect"].port == 9100  # --set wins over the environment


def test_override_errors_name_their_origin(tmp_path):
    p = write(tmp_path, BASE)
    msg = error_of(p, environ={"ONECARD_SERVICES__DETECT__PORT": "nine"})
    assert "environment variable ONECARD_SERVICES__DETECT__PORT: services.detect.port" in msg
    msg = error_of(p, sets=["supervisor.grace_s=-1"], environ={})
    assert "--set supervisor.grace_s: supervisor.grace_s" in msg
    assert "--set 'novalue': expected key.path=value" in error_of(p, sets=["novalue"], environ={})


def test_parse_value():
    assert parse_value("9000") == 9000
    assert parse_value("true") is True
    assert parse_value('"x"') == "x"
    assert parse_value("plain words") == "plain words"
    assert parse_value("[1, 2]") == [1, 2]


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


def test_service_settings_are_checked_before_anything_starts(tmp_path):
    text = BASE + '\n[services.img2img.settings]\nbackend = "diffusers"\nmax_steps = 5000\nbogus = 1\n'
    msg = error_of(write(tmp_path, text), environ={})
    assert "services.img2img.settings.max_steps: Input should be less than or equal to 1000, got 5000" in msg
    assert "services.img2img.settings.bogus: unknown key" in msg
    text = BASE + '\n[services.img2img.settings]\nbackend = "diffusers"\n'
    msg = error_of(write(tmp_path, text), environ={})
    assert "services.img2img.settings: Value error, backend 'diffusers' needs model_path" in msg


def test_supervisor_imports_no_ml_library():
    code = ("import sys; import supervisor.cli, supervisor.unit, supervisor.config, supervisor.status; "
            "from supervisor.config import load_config; load_config('configs/default.toml'); "
            "bad = [m for m in ('torch', 'onnxruntime', 'cv2', 'diffusers', 'insightface', 'numpy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

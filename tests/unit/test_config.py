from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.config.errors import ConfigError
from supervisor.config.loading import load_config, parse_value
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
    code = ("import sys; import supervisor.cli.commands, supervisor.driver.supervisor, supervisor.config.loading, "
            "supervisor.cli.status; "
            "from supervisor.config.loading import load_config; load_config('configs/default.toml'); "
            "bad = [m for m in ('torch', 'onnxruntime', 'cv2', 'diffusers', 'insightface', 'numpy') "
            "if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_env_override_keeps_the_case_of_a_variable_name_under_env(tmp_path):
    p = write(tmp_path, BASE)
    cfg = load_config(p, environ={"ONECARD_SERVICES__DETECT__ENV__HF_HOME": "/models/hf",
                                  "ONECARD_SERVICES__DETECT__SETTINGS__MAX_QUEUE": "4"})
    assert cfg.services["detect"].env == {"HF_HOME": "/models/hf"}
    assert cfg.services["detect"].settings == {"max_queue": 4}  # schema keys are lower case
    from supervisor.policy.plan import CpuQuota, build_plan
    plan = build_plan(cfg, CpuQuota(4, "affinity", 4, None, None), {})
    assert plan.services[0].env["HF_HOME"] == "/models/hf" and "hf_home" not in plan.services[0].env


def test_drain_is_nested_below_grace(tmp_path):
    from supervisor.config.derived import drain_of, termination_grace_min
    cfg = load_config(write(tmp_path, BASE), environ={})
    assert drain_of(cfg, "detect") == 3.0 and cfg.supervisor.grace_s == 5  # 5 - min(2, 2.5)
    assert termination_grace_min(cfg) > cfg.supervisor.grace_s > drain_of(cfg, "detect")
    msg = error_of(write(tmp_path, BASE.replace("grace_s = 5", "grace_s = 5\ndrain_s = 5")), environ={})
    assert "supervisor.drain_s: 5 s must be below supervisor.grace_s (5 s)" in msg
    msg = error_of(write(tmp_path, BASE + "drain_s = 9\n"), environ={})
    assert "services.img2img.drain_s: 9 s must be below supervisor.grace_s" in msg
    cfg = load_config(write(tmp_path, BASE.replace("grace_s = 5", "grace_s = 1")), environ={})
    assert drain_of(cfg, "detect") == 0.5


def test_missing_file_names_what_chose_it(tmp_path):
    missing = tmp_path / "absent.toml"
    assert f"--config: {missing}: no such file" in error_of(missing, environ={}, origin="--config")
    assert f"ONECARD_CONFIG: {missing}: no such file" in error_of(missing, environ={}, origin="ONECARD_CONFIG")


def test_secret_values_never_appear_in_errors(tmp_path):
    text = BASE + '\n[services.detect.settings]\napi_key = 12345\n'
    msg = error_of(write(tmp_path, text), environ={})
    assert "12345" not in msg and "services.detect.settings.api_key" in msg and "<redacted>" in msg


def test_a_password_inside_a_url_never_appears_in_errors(tmp_path):
    """Any value a validator echoes back, whatever the key's name: a URL's password, also one
    with the '/' or '?' that generated passwords carry."""
    for pw in ("hunter2", "pa/ss?w#rd"):
        text = BASE.replace('app = "services.detect.app:create_app"', f'app = "http://:{pw}@h:6379/0"')
        msg = error_of(write(tmp_path, text), environ={})
        assert pw not in msg and "services.detect.app" in msg and "http://:<redacted>@h:6379/0" in msg, msg


def test_an_app_path_with_anything_after_it_is_refused(tmp_path):
    for bad in ("services.detect.app:create_app\\n", "services.detect.app:create_app x"):
        text = BASE.replace('app = "services.detect.app:create_app"', f'app = "{bad}"')
        assert "services.detect.app" in error_of(write(tmp_path, text), environ={})


def test_byte_budgets_are_judged_against_the_visible_card(tmp_path):
    sizes = {"0": 16 * 2**30, "1": 80 * 2**30}
    text = BASE.replace("port = 7862", f"port = 7862\ngpu_memory_bytes = {20 * 2**30}")
    p = write(tmp_path, text + '\n[gpu]\nvisible_devices = "1"\n')
    load_config(p, environ={}, gpu_total_bytes=lambda devices: sizes[devices])  # 20 of 80 GiB: fine
    p = write(tmp_path, text + '\n[gpu]\nvisible_devices = "0"\n')
    assert "budgets add up to 1.25" in error_of(p, environ={}, gpu_total_bytes=lambda d: sizes[d])


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


def test_version():
    from supervisor.version import __version__
    r = subprocess.run([sys.executable, "-m", "supervisor", "--version"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f"onecard {__version__} (Python ")


def test_redaction_rules():
    from supervisor.config.redact import redact_argv, redact_env
    assert redact_env({"API_KEY": "a", "PATH": "/bin", "ONECARD_SERVICE_CONFIG": '{"api_key": "k", "n": 1}'}) == {
        "API_KEY": "<redacted>", "PATH": "/bin", "ONECARD_SERVICE_CONFIG": '{"api_key": "<redacted>", "n": 1}'}
    assert redact_argv(["serve", "--api-key", "k1", "--token=k2", "--url=http://a:b@h/"]) == [
        "serve", "--api-key", "<redacted>", "--token=<redacted>", "--url=http://a:<redacted>@h/"]

"""Reading a config: the file, the ``ONECARD_*`` variables and ``--set`` in that order, the
values as TOML reads them, and one error that names every problem, where it came from
(the file, the variable, the option, what chose the file) and never a secret."""

from __future__ import annotations

import os
import subprocess
import sys

from supervisor.config.loading import load_config, parse_value
from tests.config_files import BASE, error_of, write
from tests.harness import ROOT


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


def test_app_and_command_are_exclusive(tmp_path):
    text = BASE.replace('port = 7862', 'port = 7862\ncommand = ["x"]')
    assert "exactly one of 'app' and 'command'" in error_of(write(tmp_path, text), environ={})


def test_an_app_path_with_anything_after_it_is_refused(tmp_path):
    for bad in ("services.detect.app:create_app\\n", "services.detect.app:create_app x"):
        text = BASE.replace('app = "services.detect.app:create_app"', f'app = "{bad}"')
        assert "services.detect.app" in error_of(write(tmp_path, text), environ={})


def test_bad_toml_and_missing_file(tmp_path):
    assert "not valid TOML" in error_of(write(tmp_path, "[supervisor\n"), environ={})
    assert "no such file" in error_of(tmp_path / "absent.toml", environ={})


def test_missing_file_names_what_chose_it(tmp_path):
    missing = tmp_path / "absent.toml"
    assert f"--config: {missing}: no such file" in error_of(missing, environ={}, origin="--config")
    assert f"ONECARD_CONFIG: {missing}: no such file" in error_of(missing, environ={}, origin="ONECARD_CONFIG")


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


def test_env_override_keeps_the_case_of_a_variable_name_under_env(tmp_path):
    p = write(tmp_path, BASE)
    cfg = load_config(p, environ={"ONECARD_SERVICES__DETECT__ENV__HF_HOME": "/models/hf",
                                  "ONECARD_SERVICES__DETECT__SETTINGS__MAX_QUEUE": "4"})
    assert cfg.services["detect"].env == {"HF_HOME": "/models/hf"}
    assert cfg.services["detect"].settings == {"max_queue": 4}  # schema keys are lower case
    from supervisor.policy.plan import CpuQuota, build_plan
    plan = build_plan(cfg, CpuQuota(4, "affinity", 4, None, None), {})
    assert plan.services[0].env["HF_HOME"] == "/models/hf" and "hf_home" not in plan.services[0].env


def test_parse_value():
    assert parse_value("9000") == 9000
    assert parse_value("true") is True
    assert parse_value('"x"') == "x"
    assert parse_value("plain words") == "plain words"
    assert parse_value("[1, 2]") == [1, 2]


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


def test_redaction_rules():
    from supervisor.config.redact import redact_argv, redact_env
    assert redact_env({"API_KEY": "a", "PATH": "/bin", "ONECARD_SERVICE_CONFIG": '{"api_key": "k", "n": 1}'}) == {
        "API_KEY": "<redacted>", "PATH": "/bin", "ONECARD_SERVICE_CONFIG": '{"api_key": "<redacted>", "n": 1}'}
    assert redact_argv(["serve", "--api-key", "k1", "--token=k2", "--url=http://a:b@h/"]) == [
        "serve", "--api-key", "<redacted>", "--token=<redacted>", "--url=http://a:<redacted>@h/"]


def test_only_prefixed_variables_with_a_section_and_a_key_are_overrides(tmp_path, monkeypatch):
    p = write(tmp_path, BASE)
    env = {"AAA_SORTS_FIRST": "1", "ONECARD_SUPERVISOR__GRACE_S": "6", "ONECARD_GPU": "x",
           "ONECARD_FOO__BAR": "1", "ONECARD_SUPERVISOR__": "1", "ONECARD_SERVICE_NAME": "detect"}
    assert load_config(p, environ=env).supervisor.grace_s == 6
    monkeypatch.setenv("ONECARD_SUPERVISOR__GRACE_S", "8")  # no environ given: the process's own
    assert load_config(p).supervisor.grace_s == 8


def test_set_splits_at_the_first_equals_sign_and_refuses_empty_key_parts(tmp_path):
    p = write(tmp_path, BASE)
    cfg = load_config(p, sets=["services.detect.env.QUERY=a=b"], environ={})
    assert cfg.services["detect"].env == {"QUERY": "a=b"}
    for bad in ("services..port=1", "=1", ".x=1", "x.=1"):
        assert error_of(p, sets=[bad], environ={}) == f"--set {bad!r}: expected key.path=value"


def test_setting_below_a_value_names_the_override_and_the_part(tmp_path):
    p = write(tmp_path, BASE)
    assert error_of(p, sets=["services.detect.port.x=1"], environ={}) == (
        "--set services.detect.port.x: services.detect.port.x: 'port' is a value, not a table")


def test_file_problems_name_the_file_and_what_chose_it(tmp_path):
    missing = tmp_path / "none.toml"
    assert error_of(missing, environ={}) == f"{missing}: no such file"
    assert error_of(missing, environ={}, origin="--config") == f"--config: {missing}: no such file"
    assert error_of(tmp_path, environ={}) == f"{tmp_path}: is a directory, expected a TOML file"
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[gpu]\nvisible_devices = "caf\xe9"\n')
    assert error_of(bad, environ={}).startswith(f"{bad}: cannot read: 'utf-8' codec can't decode byte 0xe9")
    utf8 = write(tmp_path, BASE + '[services.detect.env]\nGREETING = "café ✓"\n', "utf8.toml")
    assert load_config(utf8, environ={}).services["detect"].env["GREETING"] == "café ✓"


def test_without_a_file_the_defaults_are_named_and_overrides_alone_can_make_a_config():
    assert error_of(None, environ={}) == "<defaults>: services: expected at least one enabled service"
    cfg = load_config(None, sets=['services.w.command=["sleep", "1"]', "services.w.port=7870"], environ={})
    assert cfg.services["w"].command == ["sleep", "1"]


def test_every_validation_error_is_one_line_naming_its_origin(tmp_path):
    p = write(tmp_path, "[services.detect]\napp = \"services.detect.app:create_app\"\n")
    assert error_of(p, sets=["supervisor.grace_s=0"], environ={}) == (
        "--set supervisor.grace_s: supervisor.grace_s: Input should be greater than 0, got 0\n"
        f"{p}: services.detect.port: required key is missing")


def test_a_missing_required_key_says_so(tmp_path):
    p = write(tmp_path, '[services.w]\ncommand = ["x"]\n')
    assert error_of(p, environ={}) == f"{p}: services.w.port: required key is missing"


def test_the_file_is_read_as_utf_8_whatever_the_locale(tmp_path):
    """TOML is UTF-8; a supervisor started under a non-UTF-8 locale (plain C, coercion and
    UTF-8 mode off) still reads it."""
    p = write(tmp_path, BASE + '[services.detect.env]\nGREETING = "café"\n')
    assert load_config(p, environ={}).services["detect"].env["GREETING"] == "café"
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(ROOT), **{k: v for k, v in os.environ.items() if k.startswith("MUTANT")}}
    code = ("import locale, sys; from supervisor.config.loading import load_config\n"
            "assert locale.getpreferredencoding(False).lower() in ('ansi_x3.4-1968', 'ascii'), "
            "locale.getpreferredencoding(False)\n"
            f"print(load_config({str(p)!r}, environ={{}}).services['detect'].env['GREETING'] == 'caf\\xe9')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_a_nested_service_setting_is_named_by_its_full_path(tmp_path):
    text = ('[services.jobs]\napp = "services.jobs.app:create_app"\nport = 7863\n'
            '[services.jobs.settings.queue]\nbogus = 1\n')
    p = write(tmp_path, text)
    assert error_of(p, environ={}) == f"{p}: services.jobs.settings.queue.bogus: unknown key"

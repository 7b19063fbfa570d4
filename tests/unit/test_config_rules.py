"""Configuration rules to the letter: which environment variables are overrides, how
--set splits, the exact messages and whom they blame, the derived paths and timeouts,
and every limit at its boundary. test_config.py has the broad behaviour; these were
written against surviving mutants (docs/mutation-testing.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from supervisor.config.derived import UNIX_PATH_MAX, drain_of, probe_socket_of, run_dir_of, termination_grace_min
from supervisor.config.loading import load_config
from tests.harness import ROOT
from tests.unit.test_config import BASE, error_of, write

COMMAND_ONLY = """
[services.worker]
command = ["sleep", "1"]
port = 7870
"""


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


def test_a_rule_across_keys_blames_the_override_that_broke_it(tmp_path):
    p = write(tmp_path, BASE)
    assert error_of(p, sets=["supervisor.drain_s=20"], environ={}) == (
        "--set supervisor.drain_s: supervisor.drain_s: 20 s must be below supervisor.grace_s (5 s): "
        "a service's drain ends before the supervisor's SIGKILL")
    assert error_of(p, sets=["services.detect.drain_s=5"], environ={}) == (
        "--set services.detect.drain_s: services.detect.drain_s: 5 s must be below supervisor.grace_s (5 s)")
    in_file = write(tmp_path, BASE.replace("port = 7862", "port = 7862\ndrain_s = 5"), "d.toml")
    assert error_of(in_file, environ={}) == (
        f"{in_file}: services.detect.drain_s: 5 s must be below supervisor.grace_s (5 s)")


def paths_config(tmp_path, **supervisor) -> object:
    text = "[supervisor]\n" + "".join(f'{k} = "{v}"\n' for k, v in supervisor.items()) + COMMAND_ONLY
    return load_config(write(tmp_path, text), environ={})


def test_the_run_dir_and_probe_sockets(tmp_path):
    cfg = paths_config(tmp_path, control_socket="/run/onecard/control.sock")
    assert run_dir_of(cfg) == "/run/onecard/control.sock.d"
    assert probe_socket_of(cfg, "detect") == "/run/onecard/control.sock.d/probes/detect.sock"
    cfg = paths_config(tmp_path, control_socket="/run/onecard/control.sock", run_dir="/srv/od")
    assert run_dir_of(cfg) == "/srv/od" and probe_socket_of(cfg, "w") == "/srv/od/probes/w.sock"


def test_drain_timeouts_nest_below_the_grace(tmp_path):
    text = ("[supervisor]\ngrace_s = 10\n" + COMMAND_ONLY + "[services.other]\ncommand = [\"sleep\"]\nport = 7871\n"
            "drain_s = 4\n")
    cfg = load_config(write(tmp_path, text), environ={})
    assert drain_of(cfg) == 8 and drain_of(cfg, "worker") == 8 and drain_of(cfg, "other") == 4
    assert drain_of(cfg, "unknown") == 8
    cfg = load_config(write(tmp_path, text), sets=["supervisor.drain_s=6"], environ={})
    assert drain_of(cfg) == 6 and drain_of(cfg, "worker") == 6 and drain_of(cfg, "other") == 4
    cfg = load_config(write(tmp_path, text.replace("grace_s = 10", "grace_s = 3")), sets=["services.other.drain_s=1"],
                      environ={})
    assert drain_of(cfg) == 1.5  # a short grace: half of it, not grace minus 2 s


def test_the_orchestrators_grace_covers_the_services_mps_and_the_last_logs(tmp_path):
    text = "[supervisor]\ngrace_s = 10\n[gpu]\nmps_stop_timeout_s = 4\n" + COMMAND_ONLY
    p = write(tmp_path, text)
    assert termination_grace_min(load_config(p, environ={})) == 13
    assert termination_grace_min(load_config(p, sets=["gpu.mps=true"], environ={})) == 17


def test_a_service_drain_equal_to_the_grace_is_refused(tmp_path):
    p = write(tmp_path, "[supervisor]\ngrace_s = 5\n" + COMMAND_ONLY + "drain_s = 5\n")
    assert "services.worker.drain_s: 5 s must be below supervisor.grace_s (5 s)" in error_of(p, environ={})
    load_config(p, sets=["services.worker.drain_s=4.9"], environ={})


def _socket(length: int, tail: str) -> str:
    """A path of exactly `length` bytes ending in `tail`."""
    return "/tmp/" + "d" * (length - 5 - len(tail)) + tail


def test_unix_socket_paths_up_to_the_limit_are_accepted(tmp_path):
    app = '[services.detect]\napp = "services.detect.app:create_app"\nport = 7862\n'
    tail = "/probes/detect.sock"
    ok = _socket(UNIX_PATH_MAX, tail)[: -len(tail)]
    p = write(tmp_path, f'[supervisor]\nrun_dir = "{ok}"\n' + app)
    assert len(probe_socket_of(load_config(p, environ={}), "detect").encode()) == UNIX_PATH_MAX
    too_long = ok + "d"
    msg = error_of(write(tmp_path, f'[supervisor]\nrun_dir = "{too_long}"\n' + app), environ={})
    sock = too_long + tail
    assert msg.endswith(f"supervisor.run_dir: the probe socket {sock} is {UNIX_PATH_MAX + 1} bytes, over the "
                        f"{UNIX_PATH_MAX} a unix socket path may have; set a shorter supervisor.run_dir or "
                        "control_socket")
    # a command service has no probe socket: a long run_dir is fine for it
    load_config(write(tmp_path, f'[supervisor]\nrun_dir = "{too_long}"\n' + COMMAND_ONLY), environ={})
    control = _socket(UNIX_PATH_MAX, "/c.sock")
    load_config(write(tmp_path, f'[supervisor]\ncontrol_socket = "{control}"\nrun_dir = "/r"\n' + COMMAND_ONLY),
                environ={})
    msg = error_of(write(tmp_path, f'[supervisor]\ncontrol_socket = "{control}x"\nrun_dir = "/r"\n' + COMMAND_ONLY),
                   environ={})
    assert msg.endswith(f"supervisor.control_socket: {UNIX_PATH_MAX + 1} bytes, over the {UNIX_PATH_MAX} a unix "
                        "socket path may have")


def test_gpu_budgets_may_add_up_to_the_whole_card(tmp_path):
    text = BASE.replace("port = 7862", "port = 7862\ngpu_memory_fraction = 0.5").replace(
        "port = 7861", "port = 7861\ngpu_memory_fraction = 0.5")
    load_config(write(tmp_path, text), environ={})


def test_only_string_settings_named_path_or_dir_must_exist(tmp_path):
    there = tmp_path / "weights"
    there.mkdir()
    text = COMMAND_ONLY + (f'[services.worker.settings]\nweights_dir = "{there}"\ncache_path = 5\nnote = "x"\n'
                           'empty_dir = ""\n')
    load_config(write(tmp_path, text), environ={})
    msg = error_of(write(tmp_path, text.replace(str(there), str(tmp_path / "nowhere"))), environ={})
    assert msg.endswith(f"services.worker.settings.weights_dir: no such file or directory: {tmp_path / 'nowhere'}")


def test_a_service_package_without_a_settings_model_is_not_checked(tmp_path, monkeypatch):
    pkg = tmp_path / "pkgs" / "outer" / "inner"
    pkg.mkdir(parents=True)
    (tmp_path / "pkgs" / "outer" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text("def create_app():\n    return None\n")
    (pkg / "settings.py").write_text("NOT_THE_MODEL = 1\n")
    (tmp_path / "pkgs" / "outer" / "settings.py").write_text("raise AssertionError('the wrong package')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    text = '[services.mine]\napp = "outer.inner.app:create_app"\nport = 7870\n[services.mine.settings]\nx = 1\n'
    assert load_config(write(tmp_path, text), environ={}).services["mine"].settings == {"x": 1}


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


def test_several_rules_across_keys_are_one_line_each(tmp_path):
    p = write(tmp_path, BASE.replace("port = 7861", "port = 7862"))
    assert error_of(p, sets=["supervisor.drain_s=5"], environ={}) == (
        "--set supervisor.drain_s: supervisor.drain_s: 5 s must be below supervisor.grace_s (5 s): "
        "a service's drain ends before the supervisor's SIGKILL\n"
        f"{p}: services.img2img.port: port 7862 is already used by services.detect.port")


def test_the_door_and_containment_keys_have_their_defaults_and_bounds(tmp_path):
    p = write(tmp_path, BASE)
    s = load_config(p, environ={}).supervisor
    assert (s.health_host, s.health_max_clients, s.health_idle_timeout_s) == ("", 512, 1.0)
    assert (s.control_max_clients, s.control_idle_timeout_s, s.containment) == (1024, 1.0, "auto")
    for mode in ("cgroup2", "cgroup1", "process"):
        assert load_config(p, sets=[f'supervisor.containment="{mode}"'], environ={}).supervisor.containment == mode
    assert "supervisor.containment" in error_of(p, sets=['supervisor.containment="docker"'], environ={})
    for key, bad in (("health_max_clients", 0), ("control_max_clients", 0), ("health_idle_timeout_s", 0),
                     ("control_idle_timeout_s", 61)):
        assert f"supervisor.{key}" in error_of(p, sets=[f"supervisor.{key}={bad}"], environ={})

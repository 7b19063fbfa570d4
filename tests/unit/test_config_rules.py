"""Rules across keys and what follows from a valid config: ports that clash, paths that must
exist, each service's own settings, drain timeouts nested below the grace, the run
directory and its sockets, GPU budgets, the probe port's and the control socket's keys.
Each at its boundary, and each message blaming the key (and the override) that broke it."""

from __future__ import annotations

from supervisor.config.derived import UNIX_PATH_MAX, drain_of, probe_socket_of, run_dir_of, termination_grace_min
from supervisor.config.loading import load_config
from tests.config_files import BASE, COMMAND_ONLY, error_of, write


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


def test_service_settings_are_checked_before_anything_starts(tmp_path):
    text = BASE + '\n[services.img2img.settings]\nbackend = "diffusers"\nmax_steps = 5000\nbogus = 1\n'
    msg = error_of(write(tmp_path, text), environ={})
    assert "services.img2img.settings.max_steps: Input should be less than or equal to 1000, got 5000" in msg
    assert "services.img2img.settings.bogus: unknown key" in msg
    text = BASE + '\n[services.img2img.settings]\nbackend = "diffusers"\n'
    msg = error_of(write(tmp_path, text), environ={})
    assert "services.img2img.settings: Value error, backend 'diffusers' needs model_path" in msg


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


def test_byte_budgets_are_judged_against_the_visible_card(tmp_path):
    sizes = {"0": 16 * 2**30, "1": 80 * 2**30}
    text = BASE.replace("port = 7862", f"port = 7862\ngpu_memory_bytes = {20 * 2**30}")
    p = write(tmp_path, text + '\n[gpu]\nvisible_devices = "1"\n')
    load_config(p, environ={}, gpu_total_bytes=lambda devices: sizes[devices])  # 20 of 80 GiB: fine
    p = write(tmp_path, text + '\n[gpu]\nvisible_devices = "0"\n')
    assert "budgets add up to 1.25" in error_of(p, environ={}, gpu_total_bytes=lambda d: sizes[d])


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

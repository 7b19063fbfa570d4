"""`./dev.sh test` installs Debian's prometheus (promtool and the server) when it is missing,
as it does redis-server, and stops with a clear message when it cannot; the tests that need
promtool fail, never skip, when it is not there.

dev.sh runs here on a PATH of our own: the system's tools it needs, and stand-ins for `id`,
`apt-get` and `redis-server`, so that the absence of prometheus is injected (the machine's
own /usr/bin/promtool stays out of sight) and no package is really installed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.harness import ROOT
from tests.prometheus_server import binary
from tests.unit.test_dev_sh import ready_venv

TOOLS = ("bash", "sh", "dirname", "find", "cat", "chmod")


def script(path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def fake_path(tmp_path, uid: int = 0, apt_exit: int = 0, installed: bool = False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "apt.log"
    script(bin_dir / "id", f"echo {uid}\n")
    script(bin_dir / "redis-server", "exit 0\n")
    stub = "#!/bin/sh\\necho stand-in\\n"
    script(bin_dir / "apt-get", f"""echo "$*" >> {log}
case "$*" in *install*)
    [ {apt_exit} = 0 ] || exit {apt_exit}
    for b in promtool prometheus; do printf '{stub}' > {bin_dir}/$b; chmod +x {bin_dir}/$b; done ;;
esac
exit 0
""")
    if installed:
        for b in ("promtool", "prometheus"):
            script(bin_dir / b, "echo stand-in\n")
    return bin_dir, log


def dev_sh_test(tmp_path, bin_dir):
    env = {"PATH": str(bin_dir), "ONECARD_VENV": str(ready_venv(tmp_path)), "HOME": str(tmp_path)}
    return subprocess.run([str(ROOT / "dev.sh"), "test", "--version"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_missing_prometheus_is_installed_from_debian_before_the_tests_run(tmp_path):
    bin_dir, log = fake_path(tmp_path)
    done = dev_sh_test(tmp_path, bin_dir)
    assert done.returncode == 0, done.stderr
    assert "installing Debian's prometheus" in done.stderr
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq --no-install-recommends prometheus"]
    assert "pytest" in done.stdout + done.stderr  # then the suite runs (here: pytest --version)


def test_an_installed_prometheus_is_left_alone(tmp_path):
    bin_dir, log = fake_path(tmp_path, installed=True)
    done = dev_sh_test(tmp_path, bin_dir)
    assert done.returncode == 0, done.stderr
    assert not log.exists()


@pytest.mark.parametrize("uid, apt_exit", [(0, 100), (1000, 0)], ids=["apt-get fails", "not root"])
def test_without_prometheus_the_suite_does_not_start(tmp_path, uid, apt_exit):
    bin_dir, log = fake_path(tmp_path, uid=uid, apt_exit=apt_exit)
    done = dev_sh_test(tmp_path, bin_dir)
    assert done.returncode == 1
    assert "prometheus is not installed and could not be installed here" in done.stderr
    assert "pytest" not in done.stdout
    assert log.exists() == (uid == 0)


def test_a_missing_promtool_fails_the_test_that_needs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ONECARD_TEST_PROMTOOL", str(tmp_path / "no-promtool"))
    with pytest.raises(pytest.fail.Exception, match="not an executable"):
        binary("promtool")
    monkeypatch.delenv("ONECARD_TEST_PROMTOOL")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # no /usr/bin/promtool either
    with pytest.raises(pytest.fail.Exception, match="./dev.sh installs Debian's prometheus"):
        binary("promtool")

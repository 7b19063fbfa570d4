"""`onecard status` and `onecard stop` skip typer (supervisor/quickcli.py): the same options
as the typer commands, and what the quick parser does not take goes to typer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from supervisor.cli import quick as quickcli
from supervisor.cli.commands import app
from tests.harness import ROOT


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

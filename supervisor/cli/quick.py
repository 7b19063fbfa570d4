"""`onecard status` and `onecard stop` without typer.

Both are exec probes and operator reflexes: they must start fast also on a host busy with a
log flood, where every import costs several times its idle price. typer (with click and
pydantic behind it) is most of the start-up; these two commands need none of it. Their
options are parsed here with argparse, the same ones the typer commands declare (a test
keeps the two in step); anything this parser does not take (--help, a mistake) goes to
typer, which answers as it always has.
"""

from __future__ import annotations

import argparse


class _NotMine(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]  # argparse would print and exit
        raise _NotMine(message)


def parser(command: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"onecard {command}", add_help=False, allow_abbrev=False)
    p.add_argument("--socket")
    p.add_argument("--config", "-c")
    if command == "status":
        p.add_argument("--json", dest="as_json", action="store_true")
        p.add_argument("--watch", "-w", action="store_true")
        p.add_argument("--interval", type=float, default=1.0)
        p.add_argument("--count", type=int, default=0)
    else:
        p.add_argument("--wait", dest="wait", action="store_true", default=True)
        p.add_argument("--no-wait", dest="wait", action="store_false")
        p.add_argument("--timeout", type=float, default=120.0)
    return p


def run(argv: list[str]) -> int | None:
    """The exit code, or None when typer should handle this command line."""
    command, args = argv[0], argv[1:]
    if command not in ("status", "stop") or any(a in ("-h", "--help") for a in args):
        return None
    try:
        ns = parser(command).parse_args(args)
    except _NotMine:
        return None
    from supervisor.cli import status as st
    if command == "status":
        return st.main(ns.socket, ns.config, ns.as_json, ns.watch, ns.interval, ns.count)
    return st.stop(ns.socket, ns.config, ns.wait, ns.timeout)

"""`onecard` and `python -m supervisor`: the first thing either runs (cli/early.py), then the
command line: `status` and `stop` without typer (cli/quick.py), the rest with it
(cli/commands.py)."""

import sys


def main() -> None:
    from supervisor.cli.early import command_of, prepare
    prepare(sys.argv)
    try:
        if command_of(sys.argv) in ("status", "stop") and sys.argv[1] in ("status", "stop"):
            from supervisor.cli.quick import run
            code = run(sys.argv[1:])
            if code is not None:
                sys.exit(code)
        from supervisor.cli.commands import main as cli_main
        cli_main()
    except KeyboardInterrupt:  # Ctrl-C in a command that has no use for it: no traceback
        sys.exit(130)


if __name__ == "__main__":
    main()

"""`onecard` and `python -m supervisor`: the first thing either runs (early.py), then the CLI."""

import sys


def main() -> None:
    from supervisor.early import prepare
    prepare(sys.argv)
    try:
        from supervisor.cli import main as cli_main
        cli_main()
    except KeyboardInterrupt:  # Ctrl-C in a command that has no use for it: no traceback
        sys.exit(130)


if __name__ == "__main__":
    main()

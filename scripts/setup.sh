#!/usr/bin/env bash
# Set up .venv with everything prefect-rl needs (CPU torch from the machine's local wheel).
# Skipped when nothing changed: .venv/.setup-stamp holds the sha256 of pyproject.toml
# (and of this script) from the last setup that succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

# pip is silent when it succeeds and prints its whole log when it fails.
pip_quiet() {
    local log
    log=$(mktemp)
    if ! .venv/bin/pip "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_quiet install --upgrade pip
# torch first, pinned: this takes the CPU wheel on disk instead of a multi-GB CUDA build.
pip_quiet install "torch==2.13.0"
# one pip command for s3fs and moto[server]: installed apart, botocore leaves aiobotocore's pin.
pip_quiet install -e ".[dev]"
echo "setup: $(.venv/bin/python -c 'import torch, ray, prefect; print(f"torch {torch.__version__}, ray {ray.__version__}, prefect {prefect.__version__}")')"
echo "$want" > "$STAMP"

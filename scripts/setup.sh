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

# Each installer is silent when it succeeds and prints its whole log when it fails.
quiet() {
    local log
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, with pip and pinned: pip takes the CPU wheel on this machine's disk
# (uv does not look there), where anything else would pull a multi-GB CUDA build.
quiet .venv/bin/pip install "torch==2.13.0" "uv==0.13.9"
# The rest with uv: the same versions pip resolves (checked package by package on
# 2026-12-04), in seconds instead of about a minute of pip. The installed torch
# satisfies the project's range, so uv leaves it alone. --compile-bytecode, as pip
# does: uv writes no .pyc by default, and with PYTHONDONTWRITEBYTECODE set (as on
# these machines) every process would compile torch and transformers again. One
# command for s3fs and moto[server]: installed apart, botocore would leave
# aiobotocore's pin.
quiet .venv/bin/uv pip install --python .venv/bin/python --compile-bytecode -e ".[dev]"
echo "setup: $(.venv/bin/python -c 'import torch, ray, prefect; print(f"torch {torch.__version__}, ray {ray.__version__}, prefect {prefect.__version__}")')"
echo "$want" > "$STAMP"

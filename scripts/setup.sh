#!/usr/bin/env bash
# Set up .venv with everything prefect-rl needs (CPU torch from the machine's local wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch first, pinned: this takes the CPU wheel on disk instead of a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
# one pip command for s3fs and moto[server]: installed apart, botocore leaves aiobotocore's pin.
.venv/bin/pip install -q -e ".[dev]"

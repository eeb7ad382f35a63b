#!/usr/bin/env bash
# Set up and pass the tests: what `.ci/run` runs, and what the README tells you to run.
# Tests start the services they need themselves (a Prefect server + worker,
# a moto S3 server on loopback, local Ray clusters) and stop them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
# Three workers, whole files each (a file's module fixtures, such as a Prefect
# server and worker, start once). The suite now keeps both cores busy (1697 CPU s
# in an 889 s run with four workers): on a quiet machine three took 787 s of pytest
# where four took 803-841 s, with one Ray cluster and Prefect server fewer.
# Each worker has its own Ray cluster. Files go out longest first, in
# tests/conftest.py's order (LONGEST_FILES), not xdist's most-tests-first.
# `bash scripts/test.sh -n 4` overrides the worker count.
.venv/bin/python -m pytest -m "not gpu" -n 3 --dist loadfile --no-loadscope-reorder \
    --durations=20 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest ran no tests: failing" >&2; exit 1; fi
exit "$rc"

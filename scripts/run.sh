#!/usr/bin/env bash
# Set up and run the main job: `bash scripts/run.sh [CONFIG] [prefect-rl run options]`.
# With no config (only options, or nothing) it runs configs/tiny-cpu.yaml, the
# embedded default (tiny model, embedded engine, local Ray, local disk, Prefect's
# local server or $PREFECT_API_URL):
#   bash scripts/run.sh
#   bash scripts/run.sh --set run.iterations=25
#   bash scripts/run.sh configs/gpu-0.5b.yaml --plain
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# No RAY_AUTH_MODE here: the CLI turns Ray's auth off only for the local cluster it
# starts itself; a cluster at ray.address keeps the auth you gave it (docs/security.md).
export PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
if [ $# -eq 0 ] || [[ "$1" == -* ]]; then
    set -- configs/tiny-cpu.yaml "$@"
fi
exec .venv/bin/prefect-rl run "$@"

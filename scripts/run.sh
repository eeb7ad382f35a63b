#!/usr/bin/env bash
# Set up and run the main job on the embedded default (tiny model, embedded
# engine, local Ray, local disk, Prefect's local server or $PREFECT_API_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/prefect-rl run "${@:-configs/tiny-cpu.yaml}"

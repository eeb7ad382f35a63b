"""The CLI's temporary Prefect server starts with analytics off.

A user's first ``prefect-rl run`` has no PREFECT_API_URL, so Prefect starts a
temporary server of its own, which takes its settings from the CLI's
environment. With analytics on, that server posts telemetry as it starts and,
off the internet, logs ``ERROR | prefect.server.services.telemetry - Failed to
send telemetry`` as the run's first line. A fresh process, with no Prefect
setting in its environment or profile, runs the CLI's ``main`` (the cheap
``runs`` command), then starts the temporary server as a flow run does and reads
the server's own settings back over its API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, sys
assert "PREFECT_SERVER_ANALYTICS_ENABLED" not in os.environ
from flows.cli import main
assert main(["runs", sys.argv[1]]) == 0
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:  # no PREFECT_API_URL: the temporary server
    settings = client.request("GET", "/admin/settings").json()
print(json.dumps({"url": str(client.api_url), "analytics": settings["server"]["analytics_enabled"]}))
"""


def test_the_clis_temporary_prefect_server_runs_without_analytics(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_PROFILE")
    }
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile, no profile's server
    # A loaded 2-core machine once took longer than the default 20 s to start one.
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "90"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "runs")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["url"].startswith("http://127.0.0.1:"), seen  # Prefect's temporary server
    assert seen["analytics"] is False, seen
    assert "Failed to send telemetry" not in out.stderr, out.stderr[-3000:]

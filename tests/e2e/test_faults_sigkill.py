"""The fault matrix's row (c): each step's SIGKILL of the flow process, then a new
run (one process per fault), ending byte-identical to the uninterrupted run
(tests/e2e/fault_matrix.py); also what a killed run leaves running: nothing. In
a file of its own, so that an xdist worker runs it beside test_faults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.config import load_config
from tests.e2e.fault_matrix import BASE, PLAN, assert_records_complete, final_weights, overrides
from tests.e2e.services import rl_run_args, run_to_exit

pytestmark = pytest.mark.slow


def describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
        except OSError:
            pass
    return "\n".join(out)


def test_sigkilled_flow_process_resumes_and_leaves_nothing_running(
    ray_cluster, prefect_api, matrix_reference, tmp_path
):
    """Each step's SIGKILL, then a rerun. The first run is a user's first command: no
    PREFECT_API_URL (Prefect's temporary server) and a local Ray cluster; everything it
    started ends with it. The later runs join the session's server and Ray cluster."""
    from engines.group import EngineGroup

    faults = [{"step": s, "iteration": k, "kind": "sigkill"} for s, k in PLAN.items()]
    over = overrides(tmp_path, "faults-sigkill", faults)
    cli = rl_run_args(BASE, over)
    alone = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    alone["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile's server either
    # Prefect's temporary server gets 20 s to start by default; a loaded 2-core CI
    # machine once took longer ("Timed out while attempting to connect").
    alone["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "90"
    shared = {**os.environ, "PREFECT_API_URL": prefect_api}
    joined = ["--set", f"ray.address={ray_cluster.get_runtime_context().gcs_address}"]
    codes = []
    for attempt in range(len(PLAN) + 2):
        first = attempt == 0
        code, err, left = run_to_exit(
            cli if first else cli + joined, alone if first else shared, settle=first
        )
        codes.append(code)
        if first:
            # The temporary Prefect server, the local Ray cluster (GCS, raylet,
            # agents, workers) and the engines all ended with the killed run.
            assert code == -9, err[-3000:]
            assert left == [], f"left running after the SIGKILL:\n{describe(left)}"
        if code == 0:
            break
        assert code == -9, err[-3000:]
    assert codes == [-9] * len(PLAN) + [0], codes
    from storage.run_store import RunStore

    cfg = load_config(BASE, over)
    store = RunStore(cfg.storage, over["run.name"])
    assert final_weights(store) == matrix_reference
    assert_records_complete(store)
    # On a cluster at ray.address the engines outlive the run (they serve its last version).
    EngineGroup(cfg.run.name, cfg.engines, namespace=cfg.ray.namespace).shutdown()

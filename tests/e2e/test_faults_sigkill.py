"""The fault matrix's row (c): each step's SIGKILL of the flow process, then a new
run (one process per fault), ending byte-identical to the uninterrupted run
(tests/e2e/fault_matrix.py); also what a killed run leaves running: nothing. In
a file of its own, so that an xdist worker runs it beside test_faults.py."""

from __future__ import annotations

import os
import shutil

import pytest

from flows.config import load_config
from tests.e2e.fault_matrix import BASE, PLAN, assert_records_complete, final_weights, overrides
from tests.e2e.services import migrated_db, rl_run_args, run_to_exit

pytestmark = pytest.mark.slow


def test_sigkilled_flow_process_resumes_and_leaves_nothing_running(
    ray_cluster, prefect_api, matrix_reference, tmp_path, tmp_path_factory
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
    # Its database already migrated, as a user's later commands find it (the session's
    # server left a copy): migrating an empty one is half the temporary server's start
    # on 2 cores, and tests/integration/test_temporary_server.py starts one from nothing.
    (tmp_path / "prefect-home").mkdir()
    shutil.copyfile(migrated_db(tmp_path_factory), tmp_path / "prefect-home" / "prefect.db")
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
            assert code == -9, err[-3000:]
            # What the killed run left is watched while the reruns go on: Ray's agents
            # end about a minute after their cluster, which no rerun needs to wait for.
            first_left = left
        if code == 0:
            break
        assert code == -9, err[-3000:]
    assert codes == [-9] * len(PLAN) + [0], codes
    # The temporary Prefect server, the local Ray cluster (GCS, raylet, agents,
    # workers) and the engines all ended with the killed first run.
    left = first_left.result(timeout=120)
    assert left == [], "left running after the SIGKILL:\n" + "\n".join(left)
    from storage.run_store import RunStore

    cfg = load_config(BASE, over)
    store = RunStore(cfg.storage, over["run.name"])
    assert final_weights(store) == matrix_reference
    assert_records_complete(store)
    # On a cluster at ray.address the engines outlive the run (they serve its last version).
    EngineGroup(cfg.run.name, cfg.engines, namespace=cfg.ray.namespace).shutdown()

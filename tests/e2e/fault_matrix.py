"""The fault matrix's shared parts: the small run every row makes (``BASE`` plus
``overrides``), where each step's fault fires (``PLAN``, ``KILL_PLAN``), the
checks every row ends with, and the uninterrupted run's weights of every version
(``reference_weights``), made once per pytest run and read by every file of the
matrix (``test_faults.py``, ``test_faults_sigkill.py``) and by ``test_multinode.py``
(its shorter run's last version is this run's), on any xdist worker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flows.config import load_config
from flows.driver import run_plain
from tests.e2e.services import locked, run_dir

ITERATIONS = 6
# One step per iteration; save is due at even iterations (save_interval 2).
BASE = "configs/tiny-cpu.yaml"  # every run here: this file plus overrides
# save_background fires inside the background checkpoint write of a due save (2, 4).
PLAN = {
    "rollout": 1,
    "save": 2,
    "train": 3,
    "publish": 4,
    "reload": 5,
    "verify": 6,
    "save_background": 4,
}
# The killed actors, in the same run as PLAN's exceptions: no (step, iteration) of both.
KILL_PLAN = {
    "rollout": 2,
    "save": 4,
    "train": 5,
    "publish": 6,
    "reload": 1,
    "verify": 3,
    "save_background": 2,
}


def overrides(root: Path, name: str, faults: list[dict] | None = None) -> dict:
    return {
        "run.name": name,
        "run.iterations": ITERATIONS,
        "run.save_interval": 2,
        "storage.root": str(root),
        "storage.lease_ttl_s": 3,
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
        "tasks.retries": 2,
        "tasks.retry_delay_s": [0.1],
        "faults": faults or [],
        # By hand, PREFECT_RL_DELTA_MATRIX=1: every row (and its reference) with delta
        # versions, a full one every 4 (not in CI: storage/test_delta.py covers deltas,
        # test_s3_run.py a run with them on).
        **(
            {"weights.delta": "on", "weights.full_every": 4}
            if os.environ.get("PREFECT_RL_DELTA_MATRIX") == "1"
            else {}
        ),
    }


def final_weights(store, version: int = ITERATIONS) -> dict[str, str]:
    """The safetensors files of ``version`` (the last by default), by name: their sha256
    (of the full files, also when the version is stored as a delta: weights.delta)."""
    manifest = store.read_manifest(version).rebuilt()
    return {f.name: f.sha256 for f in manifest.files if f.name.endswith(".safetensors")}


def assert_records_complete(store, iterations: int = ITERATIONS) -> None:
    for k in range(1, iterations + 1):
        steps = set(store.committed_steps(k))
        assert {"rollout", "train", "save", "publish", "reload-e0", "iteration"} <= steps, (
            k,
            steps,
        )
    assert [m["iteration"] for m in store.read_metrics()] == list(range(1, iterations + 1))
    metrics_lines = store.fs.cat_file(f"{store.url}/metrics.jsonl").decode().strip().splitlines()
    assert len(metrics_lines) == iterations


def reference_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    """The uninterrupted run's weights by version (1..ITERATIONS), made by the first
    caller of this pytest run; the others wait for it and read them (the run is tens
    of seconds on 2 cores).
    xdist workers share the folder above their own temporary folders; it is new for
    every pytest run, so no run reads another's weights."""
    path = run_dir(tmp_path_factory) / "fault-matrix-reference.json"
    with locked(path):
        if not path.exists():
            root = tmp_path_factory.mktemp("ref")
            ctx, _, _ = run_plain(load_config(BASE, overrides(root, "ref")), quiet=True)
            versions = range(1, ITERATIONS + 1)
            path.write_text(json.dumps({v: final_weights(ctx.store, v) for v in versions}))
        return {int(v): weights for v, weights in json.loads(path.read_text()).items()}

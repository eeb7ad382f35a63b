"""Trackers for real: TensorBoard event files, MLflow (a local sqlite store and a
real ``mlflow server`` on loopback) and W&B offline runs. A resumed run goes on
in the same tracker run, and an iteration logged before the crash is not logged
again."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flows.config import load_config
from tasks import tracking, tracking_config

ROWS = {
    k: {"iteration": k, "reward_mean": 0.1 * k, "loss": 1.0 / k, "kl": None, "example": "21"}
    for k in (1, 2, 3)
}


def _run(cfg) -> None:
    """Iterations 1-2, a crash after iteration 2 logged (its finish step never
    committed), then the resumed run: finish[2] again and finish[3]."""
    try:
        assert tracking.log_iteration(cfg, 1, ROWS[1]) != []
        assert tracking.log_iteration(cfg, 2, ROWS[2]) != []
        tracking.close()  # the process is gone; the resumed one opens the trackers anew
        assert tracking.log_iteration(cfg, 2, ROWS[2]) == []  # already logged: skipped
        assert tracking.log_iteration(cfg, 3, ROWS[3]) != []
    finally:
        tracking.close()  # no tracker left open for the next test, pass or fail


def test_off_by_default_logs_nothing(tmp_path):
    cfg = load_config(None, {"storage.root": str(tmp_path)})
    assert tracking.log_iteration(cfg, 1, ROWS[1]) == []
    assert list(tmp_path.iterdir()) == []


def test_numeric_metrics_keep_finite_numbers_only():
    row = {
        "iteration": 4,
        "loss": 0.5,
        "n": 3,
        "ok": True,
        "x": None,
        "t": "a",
        "nan": float("nan"),
    }
    assert tracking.numeric_metrics({**row, "eval": {"pass@1": 0.25}}) == {
        "loss": 0.5,
        "n": 3.0,
        "eval/pass@1": 0.25,
    }


def test_tensorboard_resume_appends_without_repeating(tmp_path):
    cfg = load_config(
        None,
        {"storage.root": str(tmp_path), "run.name": "tb", "tracking.tensorboard.enabled": True},
    )
    _run(cfg)
    folder = tmp_path / "tb" / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one file per session
    acc = EventAccumulator(str(folder), purge_orphaned_data=False).Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, round(1 / 3, 6)),
    ]
    assert set(acc.Tags()["scalars"]) == {"reward_mean", "loss"}


def _mlflow_history(uri: str, run_name: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("prefect-rl")
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`prefect_rl.run` = '{run_name}'"
    )
    assert len(runs) == 1  # the resumed run went on in the same MLflow run
    assert runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    return sorted((m.step, round(m.value, 6)) for m in history)


EXPECTED = [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6))]


def test_mlflow_local_store_resume(tmp_path):
    cfg = load_config(
        None, {"storage.root": str(tmp_path), "run.name": "ml", "tracking.mlflow.enabled": True}
    )
    _run(cfg)
    db = tmp_path / "ml" / "mlflow" / "mlflow.db"
    assert _mlflow_history(f"sqlite:///{db}", "ml") == EXPECTED


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on loopback (sqlite backend), as moto is for S3."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    args = ["server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    store = ["--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}"]
    art = ["--default-artifact-root", (tmp_path / "server-artifacts").as_uri()]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([mlflow_bin, *args, *store, *art], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start: {(tmp_path / 'server.log').read_text()}"
                )
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_mlflow_tracking_server_resume(tmp_path, mlflow_server):
    cfg = load_config(
        None,
        {
            "storage.root": str(tmp_path / "runs"),
            "run.name": "srv",
            "tracking.mlflow.enabled": True,
            "tracking.mlflow.tracking_uri": mlflow_server,
        },
    )
    _run(cfg)
    assert _mlflow_history(mlflow_server, "srv") == EXPECTED
    assert not (tmp_path / "runs" / "srv" / "mlflow").exists()  # nothing local with a server


def test_wandb_offline_resume_same_run_no_repeats(tmp_path):
    cfg = load_config(
        None, {"storage.root": str(tmp_path), "run.name": "wb", "tracking.wandb.enabled": True}
    )
    _run(cfg)
    folder = tmp_path / "wb" / "wandb"
    run_id = tracking.wandb_run_id(str(tmp_path), "wb")
    sessions = sorted(folder.glob(f"wandb/offline-run-*-{run_id}-s*"))
    assert [p.name[-2:] for p in sessions] == ["s1", "s2"]  # one run id, two sessions
    rows = [r for p in sessions for r in tracking.wandb_history(p / f"run-{run_id}.wandb")]
    assert [(int(r["_step"]), float(r["loss"])) for r in rows] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]


def test_remote_root_needs_a_local_folder():
    cfg = load_config(
        None,
        {
            "storage.root": "s3://bucket/runs",
            "weights.transport": "object-store",
            "tracking.tensorboard.enabled": True,
        },
    )
    with pytest.raises(ValueError, match="set tracking.tensorboard.log_dir"):
        tracking_config.check(cfg)


def test_mlflow_uri_with_credentials_is_refused_without_echoing_them():
    from flows.config import ConfigError

    with pytest.raises(ConfigError, match="set MLFLOW_TRACKING_USERNAME") as err:
        load_config(None, {"tracking.mlflow.tracking_uri": "https://bob:s3cret@mlflow.example"})
    assert "s3cret" not in str(err.value)


def test_a_real_run_logs_each_iteration_once_across_a_resume(ray_cluster, tmp_path):
    """Through the runtime: the finish step logs each iteration's row; a run
    continued later appends to the same event files and repeats nothing."""
    from flows.driver import run_plain

    over = {
        "run.name": "tracked",
        "storage.root": str(tmp_path),
        "run.iterations": 2,
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "tracking.tensorboard.enabled": True,
    }
    # The continued run reuses the first one's actors (each start is a process importing
    # torch); what is tested is the trackers' files, and the second run ends the actors.
    run_plain(load_config("configs/tiny-cpu.yaml", over), quiet=True, keep_actors=True)
    run_plain(load_config("configs/tiny-cpu.yaml", {**over, "run.iterations": 3}), quiet=True)
    folder = tmp_path / "tracked" / "tensorboard"
    acc = EventAccumulator(str(folder), purge_orphaned_data=False).Reload()
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2, 3]

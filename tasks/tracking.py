"""Experiment trackers: TensorBoard, MLflow and Weights & Biases (offline), each
an optional extra (``pip install 'prefect-rl[tracking]'``) and off by default.

Owns logging one metrics row per iteration to every enabled tracker, with the
iteration as the step (the ``tracking`` config section and its check before a
run are ``tasks.tracking_config``). A resumed run
continues the same tracker run (the same TensorBoard folder, the MLflow run
tagged with this run, the W&B run id derived from it), and each tracker reads
back the last iteration it holds (event files, metric history, W&B's offline
transaction logs), so an iteration at or below it is skipped: a retried or
resumed finish step never logs twice. Imports no Prefect; a tracker's library
is imported only when that tracker is on. Never logs credentials or config.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import sys
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

from storage.config import StorageConfig
from tasks.tracking_config import HasTracking, TrackingConfig, run_dir

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def last_iteration(self) -> int: ...  # 0 when nothing was logged
    def log(self, k: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def numeric_metrics(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics row (nested dicts as ``a/b``); text, None,
    booleans and the iteration itself (it is the step) are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(numeric_metrics(value, f"{name}/"))
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and name != "iteration"
        ):
            out[name] = float(value)
    return out


class TensorBoardTracker:
    """Event files in one folder; a resumed run appends a new event file there."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._last = self._read_last_step()
        self.writer = SummaryWriter(str(log_dir))

    def _read_last_step(self) -> int:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        last = 0
        for path in sorted(self.log_dir.glob("events.out.tfevents.*")):
            for event in EventFileLoader(str(path)).Load():
                if event.HasField("summary"):
                    last = max(last, int(event.step))
        return last

    def last_iteration(self) -> int:
        return self._last

    def log(self, k: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=k)
        self.writer.flush()  # on disk before the iteration commits
        self._last = k

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per prefect-rl run, found again by its tags on resume."""

    def __init__(self, uri: str, experiment: str, run_name: str, root: str, artifacts: str | None):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = (
            exp.experiment_id
            if exp is not None
            else self.client.create_experiment(experiment, artifact_location=artifacts)
        )
        tags = {"prefect_rl.run": run_name, "prefect_rl.root": root}
        query = " and ".join(f"tags.`{k}` = '{_quote(v)}'" for k, v in tags.items())
        found = self.client.search_runs([exp_id], filter_string=query, max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id

    def last_iteration(self) -> int:
        # "iteration" goes in the same log_batch as the row: one transaction in the store.
        history = self.client.get_metric_history(self.run_id, "iteration")
        return max((int(m.step) for m in history), default=0)

    def log(self, k: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = 0  # a fixed timestamp: the step orders the curve, and reruns stay identical
        rows = [Metric(key, value, stamp, k) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=[*rows, Metric("iteration", k, stamp, k)])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


class WandbTracker:
    """An offline W&B run with an id derived from the run; each session writes its
    own offline folder (``wandb sync`` merges them into one run). W&B's writer is
    asynchronous: a process killed right after a row may lose it (a rerun finish
    step logs it again; one already committed leaves a gap), never write it twice."""

    def __init__(self, project: str, folder: Path, run_name: str, run_id: str) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self._last = wandb_last_step(folder, run_id)
        session = len(list((folder / "wandb").glob(f"offline-run-*-{run_id}-s*"))) + 1
        settings = wandb.Settings(
            silent=True, console="off", x_disable_stats=True, x_sync_dir_suffix=f"s{session}"
        )
        self.run = wandb.init(
            mode="offline",
            dir=str(folder),
            project=project,
            id=run_id,
            name=run_name,
            resume="allow",
            settings=settings,
            reinit="create_new",
        )

    def last_iteration(self) -> int:
        return self._last

    def log(self, k: int, metrics: dict[str, float]) -> None:
        # commit now: a row left pending until the next step is lost if finish() races
        self.run.log(dict(metrics), step=k, commit=True)
        self._last = k

    def close(self) -> None:
        self.run.finish()


def wandb_history(path: Path) -> list[dict[str, str]]:
    """The history rows of one offline ``run-<id>.wandb`` file (W&B's transaction
    log: a leveldb-log of ``Record`` protos in 32 KiB blocks after a 7-byte header),
    each row as {key: JSON text}. A torn tail (a killed writer) ends the read."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, rows, buf, pos = path.read_bytes(), [], b"", 7
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if len(chunk) < length:
            break
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                )
    return rows


_WANDB_BLOCK = 32 * 1024


def wandb_last_step(folder: Path, run_id: str) -> int:
    """The largest step any offline session of ``run_id`` under ``folder`` logged."""
    steps = [
        int(row["_step"])
        for path in folder.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")
        for row in wandb_history(path)
        if "_step" in row
    ]
    return max(steps, default=0)


def wandb_run_id(root: str, run_name: str) -> str:
    """A W&B run id that is the same for every session of one run (root + name)."""
    return f"{run_name[:40]}-{hashlib.sha256(f'{root}/{run_name}'.encode()).hexdigest()[:12]}"


class RunTrackers:
    """The enabled trackers of one run, opened lazily on the first row."""

    def __init__(self, cfg: TrackingConfig, storage: StorageConfig, run_name: str) -> None:
        self.cfg, self.storage, self.run_name = cfg, storage, run_name
        self._trackers: dict[str, Tracker] | None = None
        self._lock = threading.Lock()  # steps run on the flow's thread pool

    def enabled(self) -> list[str]:
        return [n for n in ("tensorboard", "mlflow", "wandb") if getattr(self.cfg, n).enabled]

    def _open(self) -> dict[str, Tracker]:
        c, name, root = self.cfg, self.run_name, self.storage.root
        trackers: dict[str, Tracker] = {}
        if c.tensorboard.enabled:
            folder = c.tensorboard.log_dir or run_dir(
                self.storage, name, "tensorboard", "tracking.tensorboard.log_dir"
            )
            trackers["tensorboard"] = TensorBoardTracker(Path(folder))
        if c.mlflow.enabled:
            uri, artifacts = c.mlflow.tracking_uri, None
            if uri is None:
                local = run_dir(self.storage, name, "mlflow", "tracking.mlflow.tracking_uri")
                local.mkdir(parents=True, exist_ok=True)
                uri, artifacts = f"sqlite:///{local / 'mlflow.db'}", (local / "artifacts").as_uri()
            trackers["mlflow"] = MlflowTracker(uri, c.mlflow.experiment, name, root, artifacts)
        if c.wandb.enabled:
            folder = c.wandb.dir or run_dir(self.storage, name, "wandb", "tracking.wandb.dir")
            trackers["wandb"] = WandbTracker(
                c.wandb.project, Path(folder), name, wandb_run_id(root, name)
            )
        return trackers

    def log(
        self, k: int, row: dict[str, Any], any_step: bool = False, holding: Collection[str] = ()
    ) -> list[str]:
        """Log ``row`` as iteration ``k`` to each tracker that does not hold it yet
        (``any_step``: to each tracker not named in ``holding``, at whatever step: an
        evaluation of version k comes after the run logged later iterations, and only
        its record knows which trackers hold it); returns the trackers that logged it."""
        metrics = numeric_metrics(row)
        with self._lock:
            if self._trackers is None:
                self._trackers = self._open()
            logged = []
            for tracker_name, tracker in self._trackers.items():
                if tracker_name in holding:
                    continue
                if any_step or k > tracker.last_iteration():
                    tracker.log(k, metrics)
                    logged.append(tracker_name)
            return logged

    def close(self) -> None:
        with self._lock:
            for tracker in (self._trackers or {}).values():
                tracker.close()
            self._trackers = None


_OPEN: dict[tuple[str, str], RunTrackers] = {}
_OPEN_LOCK = threading.Lock()


def log_iteration(cfg: HasTracking, k: int, row: dict[str, Any]) -> list[str]:
    """Log iteration ``k``'s metrics row to the run's enabled trackers (none by
    default); idempotent per tracker. Returns the trackers that logged it."""
    trackers = RunTrackers(cfg.tracking, cfg.storage, cfg.run.name)
    if not trackers.enabled():
        return []
    with _OPEN_LOCK:
        trackers = _OPEN.setdefault((cfg.storage.root, cfg.run.name), trackers)
    return trackers.log(k, row)


def close() -> None:
    """Close every tracker this process opened (end of a run, or before a resume); one
    failing to close (a server gone) does not keep the others open."""
    with _OPEN_LOCK:
        opened = list(_OPEN.values())
        _OPEN.clear()
    for trackers in opened:
        try:
            trackers.close()
        except Exception as e:  # closing is best effort: the data was flushed per row
            log.warning("closing the trackers of run %s failed: %s", trackers.run_name, e)
    # finish() may return before W&B's writer has the last row: teardown waits and stops it
    if opened and "wandb" in sys.modules:
        try:
            sys.modules["wandb"].teardown()
        except Exception as e:  # best effort, as above
            log.warning("stopping W&B's writer process failed: %s", e)

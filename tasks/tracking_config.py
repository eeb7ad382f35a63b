"""The ``tracking`` config section and the check of the places it names.

Owns what a user may set for the trackers (TensorBoard, MLflow, W&B; all off by
default), where each one writes (``run_dir``: under a local storage root unless
a key names a folder) and ``check``, which ``tasks.prepare.check_run`` calls
before any flow run or run state exists: an enabled tracker's package is
installed, its folder is one a run can write in, and an http(s) MLflow
tracking server answers. Each refusal names the key and the fix. The trackers
themselves are ``tasks.tracking``. Imports no Prefect and no tracker library
(a tracker's package is imported only to check it is there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from storage.config import StorageConfig

# One attempt, this long: a tracking server that does not answer in seconds is
# down or unreachable, and MLflow's own client would retry it for minutes.
MLFLOW_PROBE_TIMEOUT_S = 3.0


class TensorBoardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Write TensorBoard event files")
    log_dir: str | None = Field(
        None, description="Event file folder; None: {storage.root}/{run.name}/tensorboard"
    )


class MlflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Log to MLflow")
    tracking_uri: str | None = Field(
        None,
        description="http://host:port of a tracking server, or sqlite:///path.db; "
        "None: sqlite:///{storage.root}/{run.name}/mlflow.db",
    )
    experiment: str = Field("prefect-rl", description="MLflow experiment the run is logged in")

    @model_validator(mode="after")
    def _no_credentials(self) -> MlflowConfig:
        # The config lands in run.json and flow parameters; the message never repeats the URI.
        scheme, sep, rest = (self.tracking_uri or "").partition("://")
        if sep and "@" in rest.split("/", 1)[0]:
            raise ValueError(
                f"tracking.mlflow.tracking_uri ({scheme}://...) contains credentials; remove "
                "them and set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN) in the environment"
            )
        return self


class WandbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Write an offline Weights & Biases run")
    project: str = Field("prefect-rl", description="W&B project the run is logged in")
    dir: str | None = Field(
        None,
        description="Offline run folder (upload later with `wandb sync`); "
        "None: {storage.root}/{run.name}/wandb",
    )


class TrackingConfig(BaseModel):
    """Which trackers receive each iteration's metrics row; all off by default."""

    model_config = ConfigDict(extra="forbid")

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    mlflow: MlflowConfig = MlflowConfig()
    wandb: WandbConfig = WandbConfig()


class HasTracking(Protocol):
    # RunConfig satisfies this; the tracking modules do not import tasks.config.
    tracking: TrackingConfig
    storage: StorageConfig
    run: Any  # RunSection: .name


def run_dir(storage: StorageConfig, run_name: str, what: str, key: str) -> Path:
    """``{root}/{run}/{what}`` for a local storage root; a remote root needs ``key`` set."""
    root = storage.root.removeprefix("file://")
    if "://" in root:
        raise ValueError(
            f"tracking on an object-store storage.root ({storage.root.split('://')[0]}://...) "
            f"needs a local folder; set {key}"
        )
    return Path(root).resolve() / run_name / what


def check(cfg: HasTracking) -> None:
    """Refuse, before any run state exists, an enabled tracker whose package is not
    installed, whose folder a run cannot write in (a file, not writable), or whose
    http(s) MLflow tracking server does not answer. Creates nothing."""
    from storage.fs import check_local_folder  # here: config loading imports this module

    t = cfg.tracking
    needs = {
        "tensorboard": (t.tensorboard.enabled, "tensorboard", "log_dir", t.tensorboard.log_dir),
        "mlflow": (t.mlflow.enabled, "mlflow", "tracking_uri", t.mlflow.tracking_uri),
        "wandb": (t.wandb.enabled, "wandb", "dir", t.wandb.dir),
    }
    for name, (on, module, leaf, where) in needs.items():
        if not on:
            continue
        try:
            __import__(module)
        except ImportError:
            raise ValueError(
                f"tracking.{name}.enabled needs the {module} package; "
                "pip install 'prefect-rl[tracking]'"
            ) from None
        key = f"tracking.{name}.{leaf}"
        if where is None:
            check_local_folder(str(run_dir(cfg.storage, cfg.run.name, name, key)), key)
        elif name == "mlflow":
            check_mlflow_uri(where)
        else:
            check_local_folder(str(Path(where).expanduser()), key)


def check_mlflow_uri(uri: str) -> None:
    """An http(s) tracking server must answer (any HTTP status will do: it is up);
    a file store (a path or file://) and the folder of an sqlite:/// database must
    be writable folders. Other schemes (databricks, postgresql, ...) are MLflow's
    to reach."""
    from storage.fs import check_local_folder

    key = "tracking.mlflow.tracking_uri"
    scheme, sep, rest = uri.partition("://")
    if scheme in ("http", "https") and sep:
        _probe_server(uri, key)
    elif scheme == "sqlite" and sep:
        # sqlite:///relative.db and sqlite:////abs.db: the path follows the third slash.
        db = Path(rest.removeprefix("/")).expanduser()
        check_local_folder(str(db.parent), key)  # sqlite creates the file, not its folder
    elif scheme == "file" and sep:
        check_local_folder(rest, key)
    elif not sep:
        check_local_folder(str(Path(uri).expanduser()), key)


def _probe_server(uri: str, key: str) -> None:
    import httpx  # only here: config loading imports this module

    try:
        httpx.get(uri, timeout=MLFLOW_PROBE_TIMEOUT_S, follow_redirects=False)
    except httpx.TransportError as e:
        raise ValueError(
            f"{key} {uri}: no MLflow tracking server answers there within "
            f"{MLFLOW_PROBE_TIMEOUT_S:g}s ({type(e).__name__}: {e}); start it (mlflow server "
            f"--host ... --port ...), fix {key}, or leave it unset for a local sqlite "
            "database under the run's folder"
        ) from None

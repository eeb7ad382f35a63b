"""Shared fixtures: one local Ray cluster per test session (real actors and
placement groups), and the tiny model written once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Dummy credentials for the moto S3 server, set before any Ray cluster starts so
# that train and engine actors inherit them exactly as they would real ones.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "AKIAPREFECTRLFAKE0001")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "prefect-rl-fake-secret-0123456789abcdef")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        import torch

        ray.init(
            address="local",
            num_cpus=8,
            # Every GPU of the machine, so `pytest -m gpu` runs all its files on this one cluster.
            num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            include_dashboard=False,
            namespace="prefect-rl",
            log_to_driver=False,
        )
    # No ray.shutdown() here: pytest_sessionfinish stops the cluster after every
    # other session fixture (some tear down actors) has finished with it.
    yield ray


def pytest_sessionfinish(session, exitstatus):
    """Stop the session's Ray cluster (its GCS, raylet and workers) once every
    fixture is torn down, rather than leaving it to the interpreter's exit hook."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from training.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One Prefect server (SQLite, a temporary PREFECT_HOME) for the whole session:
    in-process flow runs and the e2e worker's flow runs share it (tests tell their
    runs apart by run name). A server start costs tens of seconds on 2 cores."""
    from tests.e2e.services import PrefectServer

    server = PrefectServer(tmp_path_factory.mktemp("prefect-server")).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def prefect_api(prefect_server):
    """The session's Prefect server as this process's API; yields its URL."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        # Also process-wide, as prefect_test_harness does: contexts copied earlier see it.
        with _temporary_global_settings_context(get_settings_context()):
            yield prefect_server.api_url

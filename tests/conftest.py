"""Shared fixtures: one local Ray cluster per test session (real actors and
placement groups), and the tiny model written once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, namespace="prefect-rl", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from training.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-model")))

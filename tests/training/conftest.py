"""Shared fixtures for training tests: one small Ray cluster, the tiny model
and a local run root."""

from __future__ import annotations

import pytest
import ray

from storage.config import StorageConfig
from training.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        # address="local": always a private cluster, never one another test started.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def storage_cfg(tmp_path_factory) -> StorageConfig:
    return StorageConfig(root=str(tmp_path_factory.mktemp("runs")))

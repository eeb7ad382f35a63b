"""Shared fixtures for training tests: one small Ray cluster, the tiny model
and a local run root."""

from __future__ import annotations

import pytest

from storage.config import StorageConfig
from training.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def storage_cfg(tmp_path_factory) -> StorageConfig:
    return StorageConfig(root=str(tmp_path_factory.mktemp("runs")))

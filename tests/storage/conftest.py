"""Fixtures for storage tests: a moto S3 server (session) and a store per backend."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _load_s3_server():
    """Import tests/s3_server.py as ``s3_server`` without putting tests/ on sys.path
    (there, the tests/storage folder would shadow the ``storage`` package)."""
    if "s3_server" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "s3_server.py"
        spec = importlib.util.spec_from_file_location("s3_server", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["s3_server"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["s3_server"]


_s3 = _load_s3_server()
make_bucket, moto_s3 = _s3.make_bucket, _s3.moto_s3

from storage import RunStore, S3Options, StorageConfig  # noqa: E402

BUCKET = "prefect-rl-test"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """HTTP endpoint of a moto S3 server with bucket ``prefect-rl-test``."""
    with moto_s3() as url:
        make_bucket(url, BUCKET)
        yield url


@pytest.fixture(params=["local", "s3"])
def cfg(request: pytest.FixtureRequest, tmp_path: Path) -> StorageConfig:
    """A fresh storage root on local disk or on the moto S3 server."""
    if request.param == "local":
        return StorageConfig(root=str(tmp_path / "runs"))
    url = request.getfixturevalue("s3_endpoint")
    return StorageConfig(
        root=f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", s3=S3Options(endpoint_url=url)
    )


@pytest.fixture
def store(cfg: StorageConfig) -> RunStore:
    return RunStore(cfg, "run1")

"""The e2e tests' shared fixtures (beside tests/conftest.py's session services)."""

from __future__ import annotations

import pytest

from tests.e2e.fault_matrix import reference_weights


@pytest.fixture(scope="session")
def matrix_reference(ray_cluster, tmp_path_factory) -> dict[str, str]:
    """The fault matrix's uninterrupted run: its final weights, one run per pytest run."""
    return reference_weights(tmp_path_factory)

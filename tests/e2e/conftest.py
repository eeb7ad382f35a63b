"""The e2e tests' shared fixtures (beside tests/conftest.py's session services)."""

from __future__ import annotations

import pytest

from tests.e2e.fault_matrix import ITERATIONS, reference_weights


@pytest.fixture(scope="session")
def matrix_versions(ray_cluster, tmp_path_factory) -> dict[int, dict[str, str]]:
    """The fault matrix's uninterrupted run: the weights of each version, by version,
    one run per pytest run."""
    return reference_weights(tmp_path_factory)


@pytest.fixture(scope="session")
def matrix_reference(matrix_versions) -> dict[str, str]:
    """The fault matrix's uninterrupted run: its final weights."""
    return matrix_versions[ITERATIONS]

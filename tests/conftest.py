"""Shared fixtures: one local Ray cluster per test session (real actors and
placement groups), and the tiny model written once."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# No Ray metrics export in tests (no test reads them; the product never does): every
# Ray process (raylet, agents, each worker and actor) then skips its periodic metrics
# work. An idle 8-CPU cluster used 5 CPU s a minute with it and 2.2 without, and the
# suite keeps a cluster per xdist worker (plus the clusters its runs start) on 2 cores.
# Inherited by every process the tests start, as RAY_AUTH_MODE is.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
# Dummy credentials for the moto S3 server, set before any Ray cluster starts so
# that train and engine actors inherit them exactly as they would real ones.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "AKIAPREFECTRLFAKE0001")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "prefect-rl-fake-secret-0123456789abcdef")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# The evaluate-versions tests' injected reward faults (tests/integration/eval_rewards.py)
# live in a folder of this test session's own, inherited by the Ray workers that score
# shards: two sessions on one machine (a CI clone beside a checkout) once consumed each
# other's marker, and a shard that should have failed once did not.
if "PREFECT_RL_EVAL_FAULTS" not in os.environ:  # xdist workers inherit the controller's
    os.environ["PREFECT_RL_EVAL_FAULTS"] = tempfile.mkdtemp(prefix="prefect-rl-eval-faults-")


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
        from tasks.cluster import stop_log_monitor

        stop_log_monitor()  # the product's local clusters run without one too
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
    runs apart by run name). A server start costs tens of seconds on 2 cores; all but
    the first of a pytest run start on the first's migrated database."""
    from tests.e2e.services import PrefectServer, migrated_db

    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"))
    server.start_seeded(migrated_db(tmp_path_factory))
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
            from prefect.logging.handlers import APILogHandler

            # The in-process flows' last logs go to the server while it still runs:
            # left queued, the log worker sent them at the interpreter's exit, after
            # the server stopped, and retried for ~70 s ("Error logging to API").
            APILogHandler().flush()


# The files that take longest, longest first (seconds: a file's setup, call and
# teardown times summed from `--durations=0` of a full run on a quiet 2-core machine,
# 3 workers, 2026-12-06; the list ends where a file takes half a minute).
# `scripts/test.sh` runs xdist with whole files per worker in this order
# (--no-loadscope-reorder: xdist's default hands out files with many tests first,
# which leaves these few-test files for the end, one worker each). Started first,
# they run side by side while the quick files fill the other workers, and none of
# them is left to run alone at the end. Whichever of test_multinode.py, test_faults.py
# and test_faults_sigkill.py needs it first makes the fault matrix's reference run
# (tests/e2e/fault_matrix.py); the others read it.
LONGEST_FILES = [  # seconds of each file's tests, 3 workers, a quiet 2-core run (2026-12-06)
    "tests/e2e/test_multinode.py",  # 277
    "tests/e2e/test_deployments.py",  # 267
    "tests/e2e/test_faults.py",  # 206
    "tests/e2e/test_algorithms.py",  # 195
    "tests/e2e/test_pipeline.py",  # 190
    "tests/e2e/test_faults_sigkill.py",  # 187
    "tests/integration/test_colocate.py",  # 127
    "tests/integration/test_security.py",  # 115
    "tests/integration/test_weight_transports.py",  # 105
    "tests/training/test_critic.py",  # 85
    "tests/e2e/test_agentic.py",  # 78
    "tests/integration/test_run.py",  # 62
    "tests/training/test_group.py",  # 60
    "tests/engines/test_http_launcher.py",  # 53
    "tests/integration/test_evaluate_versions.py",  # 49
    "tests/integration/test_s3_run.py",  # 44
    "tests/training/test_loss_kinds_train.py",  # 37
    "tests/engines/test_engine_tp.py",  # 33
    "tests/integration/test_tracking.py",  # 33
    "tests/engines/test_engine_availability.py",  # 30
]


def pytest_collection_modifyitems(session, config, items):
    """The longest files first, in LONGEST_FILES' order; then files with a slow test;
    then the rest. A stable sort: each file's tests keep their order."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def key(item) -> int:
        path = item.nodeid.split("::")[0]
        return rank.get(path, len(rank) + (0 if path in slow else 1))

    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist skips it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` that keeps the long files apart. xdist queues a worker's
    next file while its last tests still run (a worker starts a test only once it
    knows the one after), so a long file could wait minutes behind another: a worker
    still busy with a long file is queued a quick file (the queue's last) instead."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestApart(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            busy_long = any(
                scope in LONGEST_FILES and not all(tests.values())
                for scope, tests in self.assigned_work.get(node, {}).items()
            )
            if busy_long and len(self.workqueue) > 1:
                # The queue runs longest first (LONGEST_FILES, then collection order).
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return LongestApart(config, log)

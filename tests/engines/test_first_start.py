"""A new run's first start reads as a start, not a fault: the reload step finds
engine 0 not alive and starts it (``tasks.serving.transports.disk_engine_serves``), which
logs INFO "starting" and no WARNING. A restart after a kill still warns
(``test_engine_group.py::test_engine_killed_mid_rollout_is_restarted``)."""

from __future__ import annotations

import logging

from flows.config import load_config
from tasks.context import RunContext
from tasks.prepare import publish_base
from tasks.serving.transports import disk_engine_serves


def test_a_first_engine_start_logs_starting_and_no_warning(
    ray_cluster, tiny_dir, run_name, tmp_path, caplog
):
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        {"storage.root": str(tmp_path), "run.name": run_name, "engines.num_engines": 1},
    )
    ctx = RunContext(cfg=cfg, base_model_path=str(tiny_dir))
    publish_base(ctx)  # v0, as prepare_run leaves it
    group = ctx.engines()
    caplog.set_level(logging.INFO)
    try:
        disk_engine_serves(ctx, group, 0, 0)
        assert group.is_alive(0)
    finally:
        group.shutdown()
    ours = [r for r in caplog.records if r.name.startswith(("engines", "prefect_rl", "training"))]
    assert f"starting {group.actor_name(0)} at version 0" in [r.getMessage() for r in ours]
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []

"""Maintenance flows on the default local cluster, where no engine outlives the
flow run that started it: verify-engines starts each engine on its recorded
version and says so, rather than failing on an engine that cannot exist."""

from __future__ import annotations

import uuid

from tests.integration.test_run import tiny_cfg


def test_verify_engines_on_a_local_cluster_starts_the_recorded_version(
    ray_cluster, prefect_api, tmp_path
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from flows.maintenance_flows import verify_engines_flow
    from tasks import lease as run_lease
    from tasks.prepare import check_run, prepare_run

    name = f"local-{uuid.uuid4().hex[:6]}"
    cfg = tiny_cfg(tmp_path, name)
    assert cfg.ray.address is None  # the default: a local cluster per flow run
    check_run(cfg)
    ctx = prepare_run(cfg)  # run.json and v0, as a first run leaves them
    ctx.store.record_serving(0, 0)
    run_lease.release(ctx)  # renewals stopped first, then released
    try:
        state = verify_engines_flow(run_name=name, storage_root=cfg.storage.root, return_state=True)
        assert state.is_completed(), state.message
        assert state.result() == [{"engine": 0, "version": 0, "verified": True}]
        APILogHandler().flush()
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(state.state_details.flow_run_id)
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        text = "\n".join(log.message for log in logs)
        assert name in run.tags
        assert "uses a local Ray cluster (no ray.address)" in text
        assert "ray start --head" in text  # how to keep engines alive
        assert f"engine 0 of run '{name}' serves v0, as recorded" in text
        assert ctx.store.read_lease().released  # a reader: it never took the lease
    finally:
        ctx.engines().shutdown()

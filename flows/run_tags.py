"""Tag the current flow run with the run name, so the UI filters a run's history
(training and maintenance alike) by one tag."""

from __future__ import annotations


def tag_flow_run(run_name: str) -> None:
    """Add ``run_name`` to the tags of the flow run this is called in (once)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:  # not inside a flow run
        return
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run.id)
        if run_name not in current.tags:
            client.update_flow_run(flow_run.id, tags=[*current.tags, run_name])

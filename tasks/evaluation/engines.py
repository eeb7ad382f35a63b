"""The evaluation's own engines: a group apart from the run's, loaded version by version.

Owns the group an evaluation starts (actors ``{run}/{plan.group_name}/engine/{i}``,
placement groups of the same prefix, so a training run's engines and placement
groups on the same cluster are never found, reused or removed by it), bringing
one of its engines to a version (restart on it, or pause / reload from disk /
continue) and the check that it serves it, and one shard's scoring through the
group. It reads versions from the run (a local folder, or a verified pull into
the engines' node cache) and never writes into the run: no serving record, no
ledger, no lease. No Prefect.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.group import EngineGroup
from rollout.sharded_eval import ShardScore, score_shard
from tasks.evaluation.plan import EvalPlan
from tasks.rollouts.partial import on_version
from tasks.rollouts.services import rollout_io
from tasks.serving.engine import served_version
from tasks.serving.transports import engine_weights, reload_on, start_on
from tasks.serving.verify import check_serves

log = logging.getLogger("prefect_rl.evaluation")


def eval_group(plan: EvalPlan) -> EngineGroup:
    """The evaluation's engine group (names only; nothing starts here)."""
    cfg = plan.ctx.cfg
    return EngineGroup(
        f"{plan.run}/{plan.group_name}",
        cfg.engines,
        namespace=cfg.ray.namespace,
        placement=None,  # never the run's shared (colocated) group
        call_timeout_s=cfg.tasks.timeout_s,
        weights_run=plan.run,
        adapters=plan.ctx.adapters(),
    )


def serve_version(plan: EvalPlan, engine_id: int, version: int) -> dict[str, Any]:
    """Bring engine ``engine_id`` of the evaluation to ``version`` and check that it
    serves it (VersionMismatch otherwise); what it took."""
    ctx, group = plan.ctx, eval_group(plan)
    weights = engine_weights(ctx, group, engine_id, version)
    if not group.is_alive(engine_id):  # its first start, or a dead one
        start_on(ctx, group, engine_id, version, weights)
        how = "started"
    elif served_version(ctx, group, engine_id) != str(version):
        reload_on(ctx, group, engine_id, version, weights.path)
        how = "reloaded"
    else:
        how = "already served"
    check_serves(
        ctx, group, engine_id, version, fix="rerun the evaluation (its engines are its own)"
    )
    return {"engine": engine_id, "version": version, "how": how, "pull": weights.pull}


def run_shard(plan: EvalPlan, version: int, shard: int) -> ShardScore:
    """Score shard ``shard`` of ``version`` on the evaluation's engines (they serve
    ``version``: the flow loads each version on every engine before its shards).

    The shard's prompts go to every engine (``generate_groups``: prompt g of the
    shard to engine g % engines), so the concurrent shards of a version share the
    engines; a dead engine is restarted on ``version`` and its share sent again."""
    ctx, group = plan.ctx, eval_group(plan)

    def restart(i: int) -> None:
        start_on(ctx, group, i, version)

    s = plan.settings
    rollout = ctx.cfg.rollout
    with rollout_io(ctx, group, version, restart, persist=False) as io:
        return score_shard(
            rollout,
            s.pass_threshold,
            s.n_samples,
            s.seed,
            version,
            shard,
            plan.shards[shard],
            ctx.tokenizer(),
            on_version(ctx, group.generate_groups, version),
            restart,
            io,
        )


def shutdown(plan: EvalPlan) -> None:
    """End the evaluation's engines and their placement groups (its own only)."""
    eval_group(plan).shutdown()

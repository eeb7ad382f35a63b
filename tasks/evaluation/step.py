"""The evaluate step: pass@1 / pass@k of the version engines serve after
iteration k (``eval.interval``; ``rollout.evaluation`` does the scoring).

It runs after verify and before finish, on the engines (the rollout turn when
colocated). Like every step it reads the ledger first: a committed evaluation
is returned, never rerun, so the metrics row of a resumed iteration is the
first run's. The plan holds the step only in iterations that are due. No Prefect.
"""

from __future__ import annotations

from typing import Any

from rollout.evaluation import due, evaluate
from tasks import colocate
from tasks.rollouts.partial import on_version
from tasks.rollouts.services import rollout_io
from tasks.runner import Step
from tasks.serving.transports import ensure_engine_serves, target_version, transport_for
from tasks.types import EvalResult


def _not_due(ctx, k: int) -> dict[str, Any] | None:
    return None if due(ctx.cfg.eval, k, ctx.cfg.run.iterations) else {"evaluated": False}


def _engines_serve_k(ctx, k: int, engine_id: int | None) -> list[str]:
    """A ``ready`` phase: every engine serves what iteration k published (a retried
    step meets a restarted engine on that version)."""
    v, group = target_version(ctx, k), ctx.engines()
    for i in range(ctx.cfg.engines.num_engines):
        ensure_engine_serves(ctx, group, i, v)
    return []


def _evaluate(ctx, k: int, engine_id: int | None) -> dict[str, Any]:
    v, group, transport = target_version(ctx, k), ctx.engines(), transport_for(ctx)

    def restart(i: int) -> None:
        transport.revive(ctx, group, i, v)
        colocate.for_rollout(ctx)  # a push (in-memory transports) woke the trainer

    cfg = ctx.cfg
    tokenizer = ctx.tokenizer()
    with rollout_io(ctx, group, k, restart, persist=False) as io:  # multi-turn: HTTP turns
        return evaluate(
            cfg.eval,
            cfg.rollout,
            cfg.run.seed,
            k,
            v,
            tokenizer,
            on_version(ctx, group.generate_groups, v),
            restart,
            io,
        )


EVALUATE = Step(
    "evaluate",
    "evaluate",
    _evaluate,
    fault="evaluate",
    kill="engine",
    turn="rollout",
    skip=_not_due,
    ready=_engines_serve_k,
    result=EvalResult,
)

"""Partial rollouts as steps (``rollout.partial``; the procedure is ``rollout.partial``).

A batch k that two versions make (``tasks.rollouts.versions.continue_source``) is two
plan nodes: ``rollout_head[k]`` (this module's step) generates every sample's
first ``rollout.partial_chunk`` tokens on v(k-1-N) and persists them unscored as
the ledger record ``rollout_head_batch``; ``rollout[k]`` (``tasks.steps``) waits
for the version switch, reads that record, continues every unfinished sample on
v(k-N) and persists the whole batch. ``tasks.plan`` puts reload and verify of
the newer version between the two, so engines switch versions only between
calls. A retried head reuses its persisted record; a retried continuation
starts again from it, so either step rebuilds the same batch.

No Prefect in here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from rollout.partial import continue_batch, generate_head
from rollout.procedure import Generated
from rollout.types import RolloutBatch
from tasks import colocate
from tasks.rollouts.services import rollout_io
from tasks.rollouts.versions import rollout_source
from tasks.runner import Step
from tasks.serving.transports import ensure_engine_serves, target_version, transport_for
from tasks.types import RolloutHeadResult

__all__ = [
    "HEAD_RECORD",
    "ROLLOUT_HEAD",
    "continue_rollout",
    "engines_serve",
    "on_version",
    "restarter",
]

HEAD_RECORD = "rollout_head_batch"  # ledger/iter_k/rollout_head_batch.json: the head's samples


def restarter(ctx, group, v: int) -> Callable[[int], None]:
    """How a rollout brings dead engine i back: on v, the trainer back to sleep."""
    transport = transport_for(ctx)

    def restart(i: int) -> None:
        transport.revive(ctx, group, i, v)
        colocate.for_rollout(ctx)  # a push (in-memory transports) woke the trainer: back to sleep

    return restart


def on_version(ctx, generate: Callable, v: int) -> Callable:
    """``generate`` (an ``EngineGroup`` call) with every request naming the weights it
    samples from: in a LoRA run version v > 0 is adapter ``v{v}`` (SGLang serves
    several at once; the embedded engine checks it is the one it serves)."""
    if ctx.cfg.train.lora is None or v == 0:
        return generate
    from wire.lora import adapter_name

    return functools.partial(generate, lora_path=adapter_name(v))


def engines_serve(ctx, source: int) -> list[str]:
    """Every engine serves what the run publishes for iteration ``source``."""
    v = target_version(ctx, source)
    group = ctx.engines()
    for i in range(ctx.cfg.engines.num_engines):
        ensure_engine_serves(ctx, group, i, v)
    return []


def _summary(batch: RolloutBatch, gen_s: float | None, reused: bool) -> dict:
    tokens = sum(len(s.response_ids) for s in batch.samples)
    unfinished = sum(s.finish_reason == "length" for s in batch.samples)
    version = batch.samples[0].weight_version if batch.samples else 0
    return {
        "samples": len(batch.samples),
        "response_tokens": tokens,
        "unfinished": unfinished,
        "gen_s": gen_s,
        "weight_version": version,
        "reused": reused,
    }


def _read_head(ctx, k: int) -> RolloutBatch | None:
    record = ctx.store.read_record(k, HEAD_RECORD)
    return None if record is None else RolloutBatch.from_json(record["batch"])


def _head_saved(ctx, k: int) -> dict | None:
    head = _read_head(ctx, k)
    return None if head is None else _summary(head, gen_s=None, reused=True)


def _head(ctx, k: int, engine_id: None) -> dict:
    v = target_version(ctx, rollout_source(ctx, k))
    group = ctx.engines()
    cfg = ctx.cfg
    generate = on_version(ctx, group.generate_groups, v)
    out = generate_head(
        cfg.rollout, cfg.run.seed, k, v, ctx.tokenizer(), generate, restarter(ctx, group, v)
    )
    ctx.store.write_record(k, HEAD_RECORD, {"batch": out.batch.to_json()})
    return _summary(out.batch, gen_s=out.gen_s, reused=False)


def continue_rollout(ctx, k: int, source: int) -> Generated:
    """Batch k whole: its persisted head continued on what iteration ``source`` published."""
    head = _read_head(ctx, k)
    if head is None:
        raise RuntimeError(
            f"rollout[k={k}] continues a partial rollout, but ledger/iter_{k:06d}/"
            f"{HEAD_RECORD}.json is missing; delete ledger/iter_{k:06d}/rollout_head.json and "
            "rerun: rollout_head[k] generates it again"
        )
    v = target_version(ctx, source)
    group = ctx.engines()
    restart = restarter(ctx, group, v)
    cfg = ctx.cfg
    with rollout_io(ctx, group, k, restart) as io:  # reward tasks (rollout.reward_workers)
        out = continue_batch(
            cfg.rollout,
            cfg.run.seed,
            head,
            v,
            ctx.tokenizer(),
            on_version(ctx, group.generate_rows, v),
            restart,
            io.score,
        )
    head_s = (ctx.store.read_record(k, ROLLOUT_HEAD.key()) or {}).get("result", {}).get("gen_s")
    return Generated(out.batch, out.gen_s + (head_s or 0.0))


ROLLOUT_HEAD = Step(
    "rollout_head",
    "rollout_head",
    _head,
    fault="rollout_head",
    kill="engine",
    turn="rollout",
    skip=_head_saved,
    ready=lambda ctx, k, engine_id: engines_serve(ctx, rollout_source(ctx, k)),
    result=RolloutHeadResult,
)

"""The steps of one RL iteration as plain functions (no Prefect in here).

The Prefect tasks in ``tasks/rl_tasks.py`` wrap these one to one, and the
plain-Python driver (``flows/driver.py``) calls them directly. Each step:
reads the ledger; brings the state it needs back from storage (dead actors are
recreated, trainer state is restored and replayed); does its work; commits.
Colocated, a step that works on a device first puts the train ranks and engines
in the state it needs (``tasks.colocate``) and records it under ``memory``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rollout.datasets import PromptSource
from rollout.rewards import load_reward
from rollout.seeding import sample_seed
from rollout.types import RolloutBatch, Sample
from tasks import colocate
from tasks.engines import (
    ensure_engine_serves,
    in_memory,
    kill_engine,
    kill_train_rank0,
    served_version,
    target_version,
    version_path,
)
from tasks.faults import maybe_fail
from tasks.ledger import run_step

log = logging.getLogger("prefect_rl.steps")


class VersionMismatch(RuntimeError):
    """An engine serves another weight version than the step expects."""


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    cache = _tokenizer.__dict__.setdefault("cache", {})
    if path not in cache:
        cache[path] = AutoTokenizer.from_pretrained(path)
    return cache[path]


def rollout(ctx, k: int) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        store, cfg = ctx.store, ctx.cfg
        saved = store.read_rollouts(k)
        if saved is not None:  # generated before a crash: replay, never regenerate
            return _rollout_summary(RolloutBatch.from_json(saved), reused=True)
        v = target_version(ctx, k - 1)
        group = ctx.engines()
        colocate.for_rollout(ctx)  # the trainer frees the devices before engines (re)load
        for i in range(cfg.engines.num_engines):
            ensure_engine_serves(ctx, group, i, v)
        memory = colocate.for_rollout(ctx)  # an in-memory update woke the trainer
        maybe_fail(ctx, "rollout", k, kill=lambda: kill_engine(group, 0))
        batch = _generate(ctx, group, k, v)
        store.write_rollouts(k, batch.to_json())
        return {**_rollout_summary(batch, reused=False), **colocate.recorded(memory)}

    return run_step(ctx, k, "rollout", work)


def _generate(ctx, group, k: int, v: int) -> RolloutBatch:
    cfg, seed = ctx.cfg, ctx.cfg.run.seed
    tok = _tokenizer(ctx.base_model_path)
    reward_fn = load_reward(cfg.rollout.reward, cfg.rollout.trusted_reward_modules)
    prompts = PromptSource(cfg.rollout, seed).batch(k)
    n = cfg.rollout.n_samples_per_prompt
    prompt_ids = [tok(p.text)["input_ids"] for p in prompts]
    seeds = [[sample_seed(seed, k, p.index, j) for j in range(n)] for p in prompts]
    sampling = {
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "max_new_tokens": cfg.rollout.max_new_tokens,
    }
    t0 = time.perf_counter()
    # A dead engine is restarted on the version this rollout needs, and its
    # groups are regenerated whole, so no group mixes versions.
    if in_memory(ctx):

        def restart(i: int) -> None:
            ensure_engine_serves(ctx, group, i, v)
            colocate.for_rollout(ctx)  # a push woke the trainer; it sleeps while we generate

    else:
        path = version_path(ctx, v)
        restart = lambda i: group.restart(i, path, v)  # noqa: E731
    groups = group.generate_groups(prompt_ids, n, sampling, seeds, restart_fn=restart)
    gen_s = time.perf_counter() - t0
    samples: list[Sample] = []
    for p, ids, outs in zip(prompts, prompt_ids, groups):
        for j, out in enumerate(outs):
            meta = out["meta_info"]
            served = int(meta["weight_version"])
            if served != v:
                raise VersionMismatch(
                    f"rollout[k={k}]: a sample came from weights v{served}, expected v{v}; "
                    "the engines were not reloaded: rerun reload_engines"
                )
            finish = meta["finish_reason"]["type"]
            if finish == "abort":
                raise RuntimeError(f"rollout[k={k}]: a request was aborted; retry the rollout")
            text = tok.decode(out["output_ids"], skip_special_tokens=True)
            samples.append(
                Sample(
                    prompt_index=p.index,
                    sample_index=j,
                    prompt_ids=list(ids),
                    response_ids=list(out["output_ids"]),
                    response_logprobs=[float(x[0]) for x in meta["output_token_logprobs"]],
                    reward=float(reward_fn(text, p.label)),
                    weight_version=served,
                    finish_reason=finish,
                    response_text=text,
                )
            )
    batch = RolloutBatch(iteration=k, n_samples_per_prompt=n, samples=samples)
    object.__setattr__(batch, "_gen_s", gen_s)
    return batch


def _rollout_summary(batch: RolloutBatch, reused: bool) -> dict[str, Any]:
    rewards = batch.rewards
    tokens = sum(len(s.response_ids) for s in batch.samples)
    gen_s = getattr(batch, "_gen_s", None)
    mean = sum(rewards) / len(rewards)
    return {
        "reward_mean": mean,
        "reward_max": max(rewards),
        "samples": len(rewards),
        "response_tokens": tokens,
        "gen_s": gen_s,
        "gen_tokens_per_s": (tokens / gen_s) if gen_s else None,
        "weight_version": batch.samples[0].weight_version if batch.samples else None,
        "reused": reused,
        "example": batch.samples[0].response_text if batch.samples else "",
    }


def train(ctx, k: int) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        trainer = ctx.trainer()
        memory, warned = _for_training(ctx, trainer, k - 1)
        maybe_fail(ctx, "train", k, kill=lambda: kill_train_rank0(trainer))
        return {**trainer.train(k), **colocate.recorded(memory), **warned}

    return run_step(ctx, k, "train", work)


def _for_training(ctx, trainer, k: int) -> tuple[colocate.Memory | None, dict[str, list[str]]]:
    """Engines asleep and the trainer awake (colocated), holding trainer state k.

    Also returns ``{"warnings": [...]}`` when restoring state k warned (a corrupt
    checkpoint skipped): merged into the step's result, the Prefect task logs
    them to the task run's log, where users look, not only a Ray worker's."""
    colocate.for_training(ctx)  # engines free the devices before any rank (re)loads
    state = trainer.ensure_state(k, ctx.base_model_path) or {}
    warned = {"warnings": list(state["warnings"])} if state.get("warnings") else {}
    return colocate.for_training(ctx), warned  # re-created ranks start awake: this reads them back


def _is_last(ctx, k: int) -> bool:
    return k == ctx.cfg.run.iterations


def save_due(ctx, k: int) -> bool:
    # release_after_publish re-creates actors from a checkpoint each iteration.
    return (
        k % ctx.cfg.run.save_interval == 0 or _is_last(ctx, k) or ctx.cfg.train.release_after_publish
    )


def save_checkpoint(ctx, k: int) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        if not save_due(ctx, k):
            return {"saved": False}
        if k in ctx.store.committed_checkpoints():
            return {"saved": True, "existing": True}
        trainer = ctx.trainer()
        memory, warned = _for_training(ctx, trainer, k)
        maybe_fail(ctx, "save", k, kill=lambda: kill_train_rank0(trainer))
        t0 = time.perf_counter()
        trainer.save(k)
        return {"saved": True, "save_s": time.perf_counter() - t0, **colocate.recorded(memory), **warned}

    return run_step(ctx, k, "save", work)


def publish_due(ctx, k: int) -> bool:
    return k % ctx.cfg.weights.publish_interval == 0 or _is_last(ctx, k)


def publish_weights(ctx, k: int) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        store = ctx.store
        if not publish_due(ctx, k):
            return {"published": False}
        memory, warned = None, {}
        if k not in store.committed_versions():
            trainer = ctx.trainer()
            memory, warned = _for_training(ctx, trainer, k)
            maybe_fail(ctx, "publish", k, kill=lambda: kill_train_rank0(trainer))
            parent = store.latest_version()
            t0 = time.perf_counter()
            trainer.export_hf(k, k, parent)
            publish_s = time.perf_counter() - t0
        else:
            publish_s = 0.0
        if ctx.cfg.train.release_after_publish:
            ctx.trainer().release()
        manifest = store.read_manifest(k)
        return {
            "published": True,
            "version": k,
            "url": store.version_url(k),
            "bytes": sum(f.bytes for f in manifest.files),
            "publish_s": publish_s,
            **colocate.recorded(memory),
            **warned,
        }

    return run_step(ctx, k, "publish", work)


def reload_engine(ctx, k: int, engine_id: int) -> dict[str, Any]:
    def work() -> dict[str, Any]:
        v = target_version(ctx, k)  # disk: the newest published version <= k
        group = ctx.engines()
        maybe_fail(ctx, "reload", k, kill=lambda: kill_engine(group, engine_id))
        t0 = time.perf_counter()
        memory = ensure_engine_serves(ctx, group, engine_id, v, force_reload=True)
        return {
            "engine": engine_id,
            "version": v,
            "reload_s": time.perf_counter() - t0,
            **colocate.recorded(memory),
        }

    return run_step(ctx, k, f"reload-e{engine_id}", work)


def verify_engine(ctx, k: int, engine_id: int) -> dict[str, Any]:
    """Read-only check, except that a dead engine is restarted on the expected version."""
    v = target_version(ctx, k)
    group = ctx.engines()
    maybe_fail(ctx, "verify", k, kill=lambda: kill_engine(group, engine_id))
    colocate.wake_engine(ctx, engine_id)  # the health check below runs a forward
    if not group.is_alive(engine_id):
        log.warning("engine %d is dead at verify[k=%d]; restarting it on v%d", engine_id, k, v)
        if in_memory(ctx):
            ensure_engine_serves(ctx, group, engine_id, v)
        else:
            group.restart(engine_id, version_path(ctx, v), v)
    served = served_version(ctx, group, engine_id)
    if served != str(v):
        raise VersionMismatch(
            f"engine {engine_id} serves weight version {served!r}, expected {str(v)!r} after "
            f"iteration {k}; rerun reload_engines for this iteration"
        )
    return {"engine": engine_id, "version": v, "verified": True}


def finish_iteration(ctx, k: int, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Append the metrics row and commit the iteration (its ledger record is written last)."""

    def work() -> dict[str, Any]:
        r, t, p = results["rollout"], results["train"], results["publish"]
        reloads = [v for key, v in results.items() if key.startswith("reload")]
        row = {
            "iteration": k,
            "reward_mean": r["reward_mean"],
            "loss": t.get("loss"),
            "kl": t.get("kl"),
            "gen_tokens_per_s": r.get("gen_tokens_per_s"),
            "train_tokens_per_s": t.get("tokens_per_s"),
            "publish_s": p.get("publish_s"),
            "reload_s": max((x.get("reload_s") or 0.0 for x in reloads), default=0.0),
            "example": r.get("example"),
        }
        ctx.store.append_metrics(k, row)
        if ctx.cfg.storage.keep_last:
            ctx.store.gc(ctx.cfg.storage.keep_last)
        return row

    return run_step(ctx, k, "iteration", work)


def first_unfinished(ctx) -> int:
    """The first iteration without a committed ``iteration`` record (the resume point)."""
    k = 1
    while k <= ctx.cfg.run.iterations and ctx.store.read_record(k, "iteration") is not None:
        k += 1
    return k

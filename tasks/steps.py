"""The steps of one RL iteration: each one's declaration and its step logic only.

Every step is a ``tasks.runner.Step``: its ledger key, colocation turn, fault
point and phases (``skip`` / ``ready`` / ``work``). ``tasks.runner.run``
applies the cross-cutting concerns (ledger first, timing, colocation turns,
fault injection, warnings, the commit); the functions here do the step itself.
``tasks.plan`` orders them into one iteration's DAG, written once:
``flows/iteration.py`` (Prefect) and ``flows/driver.py`` (plain Python) both
walk it. No Prefect in here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rollout.procedure import VersionMismatch, generate_batch, summary
from rollout.types import RolloutBatch
from tasks import faults, retention, runner, tracking
from tasks.evaluation.step import EVALUATE
from tasks.metrics_row import metrics_row
from tasks.phases import phase
from tasks.rollouts.partial import (
    ROLLOUT_HEAD,
    continue_rollout,
    engines_serve,
    on_version,
    restarter,
)
from tasks.rollouts.services import rollout_io
from tasks.rollouts.unusable import named_if_unusable
from tasks.rollouts.versions import continue_source, made_on, rollout_source
from tasks.runner import Step
from tasks.serving.transports import ensure_engine_serves, target_version, transport_for
from tasks.serving.verify import check_serves, now, rollout_version
from tasks.types import (
    IterationRow,
    PublishResult,
    ReloadResult,
    RolloutResult,
    SaveResult,
    TrainResult,
    VerifyRecord,
)
from training.types import mismatch_message

__all__ = [
    "EVALUATE",
    "FINISH",
    "ROLLOUT_HEAD",
    "STEPS",
    "VersionMismatch",
    "build_trainer_ahead",
    "finish_iteration",
    "first_unfinished",
    "publish_due",
    "publish_weights",
    "reload_engine",
    "continue_source",
    "rollout",
    "rollout_source",
    "save_checkpoint",
    "save_due",
    "train",
    "verify_engine",
]

log = logging.getLogger("prefect_rl.steps")
Result = dict[str, Any]


# -- rollout -------------------------------------------------------------------
def _rollout_saved(ctx, k: int) -> Result | None:
    saved = ctx.store.read_rollouts(k)
    if saved is None:
        return None
    # generated before a crash: replay, never regenerate
    env = ctx.cfg.rollout.environment
    return summary(RolloutBatch.from_json(saved), gen_s=None, reused=True, environment=env)


def _generate(ctx, k: int, engine_id: int | None) -> Result:
    cfg = ctx.cfg
    later = continue_source(ctx, k)
    if later is not None:  # a partial rollout: its head is persisted, the rest made here
        out = continue_rollout(ctx, k, later)
    else:
        v = target_version(ctx, rollout_source(ctx, k))
        group = ctx.engines()
        restart = restarter(ctx, group, v)
        with rollout_io(ctx, group, k, restart) as io:  # multi-turn HTTP, rewards, failure log
            out = generate_batch(
                cfg.rollout,
                cfg.run.seed,
                k,
                v,
                ctx.tokenizer(),
                on_version(ctx, group.generate_groups, v),
                restart,
                io=io,
            )
    with phase("persist"):
        ctx.store.write_rollouts(k, out.batch.to_json())
    return summary(out.batch, gen_s=out.gen_s, reused=False, environment=cfg.rollout.environment)


# -- train, save, publish ------------------------------------------------------
def _state(k_of):
    """A ``ready`` phase: the trainer holds state ``k_of(k)`` (restore + replay)."""

    def ready(ctx, k: int, engine_id: int | None) -> list[str]:
        state = ctx.trainer().ensure_state(k_of(k), ctx.base_model_path) or {}
        return list(state.get("warnings") or [])

    return ready


def build_trainer_ahead(ctx, first: int) -> threading.Thread | None:
    """In a new run, build the trainer (model load, compute copy, the kernels' first
    compile) on a thread while ``rollout[1]`` starts the engines and generates, rather
    than in ``train[1]`` after them; the step's ready phase then finds state 0 held
    (``TrainGroup.ensure_state`` builds once, a second caller waits). Only a new run,
    which has no checkpoint to restore (so no warning to report), and only when the
    trainer and the engines do not take turns on the same devices (colocated). A
    failed build is left to ``train[1]``, which builds again and reports it."""
    if first != 1 or ctx.placement() is not None:
        return None

    def build() -> None:
        try:
            ctx.trainer().ensure_state(0, ctx.base_model_path)
        except Exception as e:  # noqa: BLE001 - train[1] builds it again and fails there
            log.info("building the trainer ahead of train[1] failed (%s); train[1] will", e)

    thread = threading.Thread(target=build, name="trainer-build", daemon=True)
    thread.start()
    return thread


def _train(ctx, k: int, engine_id: int | None) -> Result:
    with named_if_unusable(ctx, k):  # rewards that make NaN: the file and how to regenerate it
        out = ctx.trainer().train(k)
    if out.get("rollout_logprob_kl_over") and ctx.cfg.run.name not in _MISMATCH_WARNED:
        _MISMATCH_WARNED.add(ctx.cfg.run.name)  # once per run and process: the row keeps each
        train = ctx.cfg.train
        kl, tau = out["rollout_logprob_kl"], out.get("temperature", 1.0)
        compiled_lora = train.lora is not None and train.compile_layers == "on"
        log.warning(mismatch_message(k, kl, train.mismatch.max_kl, tau, compiled_lora))
    return out


_MISMATCH_WARNED: set[str] = set()


def _is_last(ctx, k: int) -> bool:
    return k == ctx.cfg.run.iterations


def save_due(ctx, k: int) -> bool:
    # release_after_publish re-creates actors from a checkpoint each iteration.
    return (
        k % ctx.cfg.run.save_interval == 0
        or _is_last(ctx, k)
        or ctx.cfg.train.release_after_publish
    )


def _save_skipped(ctx, k: int) -> Result | None:
    if not save_due(ctx, k):
        return {"saved": False}
    if k in ctx.store.committed_checkpoints():
        return {"saved": True, "existing": True}
    return None


def _save(ctx, k: int, engine_id: int | None) -> Result:
    """Checkpoint k, in the background unless it is the run's last (or actors are
    released after publish, which needs it on storage): recovery never waits for
    it, as a restore falls back to the newest committed checkpoint and replays."""
    background = ctx.cfg.run.async_save and not _is_last(ctx, k)
    background = background and not ctx.cfg.train.release_after_publish
    fault = faults.take(ctx, "save_background", k) if background else None
    t0 = time.perf_counter()
    trainer = ctx.trainer()
    meta = trainer.save(k, background=background, fail_background=_fails_write(fault)) or {}
    if fault is not None and not _fails_write(fault):
        faults.fire(ctx, fault, kill=lambda: faults.kill_train_rank0(trainer))  # while it writes
    out = {"saved": True, "background": background, "save_s": time.perf_counter() - t0}
    return {**out, "warnings": list(meta.get("warnings") or [])}


def _fails_write(fault) -> bool:
    return fault is not None and fault.kind == "exception"


def publish_due(ctx, k: int) -> bool:
    return k % ctx.cfg.weights.publish_interval == 0 or _is_last(ctx, k)


def _unpublished(ctx, k: int) -> bool:
    return k not in ctx.store.committed_versions()


def _publish(ctx, k: int, engine_id: int | None) -> Result:
    """Publish trainer state k as weights/v{k}. In the background when the engines
    get their weights in memory (tensor/distributed) and it is not the run's last
    version: nothing waits for this copy but a later recovery, which falls back to
    an older committed version. Disk transports reload from it: written at once."""
    store = ctx.store
    background = transport_for(ctx).pushes and not _is_last(ctx, k)
    background = background and not ctx.cfg.train.release_after_publish
    out: Result = {"published": True, "version": k, "url": store.version_url(k)}
    if _unpublished(ctx, k):
        t0 = time.perf_counter()
        summary = ctx.trainer().export_hf(k, k, store.latest_version(), background=background)
        out["publish_s"] = time.perf_counter() - t0
        out["warnings"] = list(summary.get("warnings") or [])
        out["background"] = bool(summary.get("background"))
    else:
        out["publish_s"] = 0.0
    if ctx.cfg.train.release_after_publish:
        ctx.trainer().release()
    if not out.get("background"):
        out["bytes"] = sum(f.bytes for f in store.read_manifest(k).files)
    return out


# -- reload, verify -------------------------------------------------------------
def _reload(ctx, k: int, engine_id: int) -> Result:
    v = target_version(ctx, k)  # disk: the newest published version <= k
    t0 = time.perf_counter()
    served = ensure_engine_serves(ctx, ctx.engines(), engine_id, v, force_reload=True)
    return {
        "engine": engine_id,
        "version": v,
        "reload_s": time.perf_counter() - t0,
        **served.recorded(),
    }


def _verify(ctx, k: int, engine_id: int) -> Result:
    """Read-only check, except that a dead engine is restarted on the expected version."""
    v = target_version(ctx, k)
    group = ctx.engines()
    if not group.is_alive(engine_id):
        log.warning("engine %d is dead at verify[k=%d]; restarting it on v%d", engine_id, k, v)
        transport_for(ctx).revive(ctx, group, engine_id, v)
    served = check_serves(
        ctx,
        group,
        engine_id,
        v,
        when=f" after iteration {k}",
        fix="rerun reload_engines for this iteration",
    )
    # Rollout k was generated with what engines served after iteration rollout_source(k).
    expected = transport_for(ctx).version_after(ctx, rollout_source(ctx, k))
    sampled = rollout_version(ctx, k)
    if sampled is not None and sampled != expected:
        raise VersionMismatch(
            f"rollout[k={k}] samples carry weight_version {sampled}, expected v{expected}; "
            f"delete ledger/iter_{k:06d}/rollout.json and rollouts/iter_{k:06d}.json and rerun"
        )
    record = VerifyRecord(
        engine=engine_id,
        version=v,
        verified=True,
        served=served,
        rollout_weight_version=sampled,
        rollout_expected=expected,
        checked_at=now(),
    )
    return record.model_dump()


# -- finish -----------------------------------------------------------------------
def _finish(ctx, k: int, engine_id: None, results: dict[str, Result]) -> Result:
    """Append the metrics row; the runner then commits the iteration (written last)."""
    reloads = [results[RELOAD.key(e)] for e in RELOAD.engine_ids(ctx) if RELOAD.key(e) in results]
    row = metrics_row(ctx, k, results, reloads)
    with phase("metrics"):
        ctx.store.append_metrics(k, row)
    # Before the iteration's commit; a tracker skips an iteration it already holds.
    with phase("trackers"):
        tracking.log_iteration(ctx.cfg, k, row)
    if not ctx.cfg.storage.keep_last:
        return row
    # In the background (tasks.retention): the commit does not wait for deletions.
    # The phase is the wait for the previous iteration's pass, if it is still running.
    with phase("retention"):
        warnings = retention.start(ctx, ctx.cfg.storage.keep_last)  # PPO: the critic's too
    return {**row, "warnings": warnings} if warnings else row


# -- the declarations: what each step is --------------------------------------------
ROLLOUT = Step(
    "rollout",
    "rollout",
    _generate,
    fault="rollout",
    kill="engine",
    turn="rollout",
    skip=_rollout_saved,
    ready=lambda ctx, k, engine_id: engines_serve(ctx, made_on(ctx, k)),
    result=RolloutResult,
)
TRAIN = Step(
    "train",
    "train",
    _train,
    fault="train",
    kill="train_rank0",
    turn="training",
    ready=_state(lambda k: k - 1),
    result=TrainResult,
)
SAVE = Step(
    "save",
    "save_checkpoint",
    _save,
    fault="save",
    kill="train_rank0",
    turn="training",
    skip=_save_skipped,
    ready=_state(lambda k: k),
    result=SaveResult,
)
PUBLISH = Step(
    "publish",
    "publish_weights",
    _publish,
    fault="publish",
    kill="train_rank0",
    turn="training",
    skip=lambda ctx, k: None if publish_due(ctx, k) else {"published": False},
    needs=_unpublished,
    ready=_state(lambda k: k),
    result=PublishResult,
)
# Reload declares no turn: the transport decides it (``tasks.serving.transports``).
RELOAD = Step(
    "reload",
    "reload_engine",
    _reload,
    per_engine=True,
    fault="reload",
    kill="engine",
    result=ReloadResult,
)
# Verify is an audit: it runs every time and rewrites its record when it passes.
VERIFY = Step(
    "verify",
    "verify_engine",
    _verify,
    per_engine=True,
    fault="verify",
    kill="engine",
    turn="engine",
    audit=True,
    result=VerifyRecord,
)
FINISH = Step("iteration", "finish_iteration", _finish, result=IterationRow)  # the commit

# Every step of an iteration, in the order of the on-policy chain (``tasks.plan`` is the DAG).
STEPS: tuple[Step, ...] = (ROLLOUT, ROLLOUT_HEAD, TRAIN, SAVE, PUBLISH, RELOAD, VERIFY, EVALUATE)


# -- the steps as plain calls (tests, bench and older callers) ----------------------
def rollout(ctx, k: int) -> Result:
    return runner.run(ctx, ROLLOUT, k)


def train(ctx, k: int) -> Result:
    return runner.run(ctx, TRAIN, k)


def save_checkpoint(ctx, k: int) -> Result:
    return runner.run(ctx, SAVE, k)


def publish_weights(ctx, k: int) -> Result:
    return runner.run(ctx, PUBLISH, k)


def reload_engine(ctx, k: int, engine_id: int) -> Result:
    return runner.run(ctx, RELOAD, k, engine_id)


def verify_engine(ctx, k: int, engine_id: int) -> Result:
    return runner.run(ctx, VERIFY, k, engine_id)


def finish_iteration(ctx, k: int, results: dict[str, Result]) -> Result:
    return runner.run(ctx, FINISH, k, results=results)


def first_unfinished(store, iterations: int) -> int:
    """The first iteration <= ``iterations`` without a committed ``iteration`` record
    (the resume point); ``iterations + 1`` when the run is complete. Reads storage
    only: no lease, no Ray."""
    k = 1
    while k <= iterations and store.read_record(k, "iteration") is not None:
        k += 1
    return k

"""Train group on a real Ray cluster: steps, checkpoints, export and recovery.

The key invariant: save -> kill the actors -> ensure_state(k) restores and
replays to weights byte-identical (sha256) to an uninterrupted run. Actor
start-up dominates the time here, so each scenario creates as few groups as
it can.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from train_helpers import make_group, weight_shas, write_rollouts
from transformers import AutoModelForCausalLM

from storage.run_store import RunStore
from training.actor import StateMismatchError

PROBE = [[1, 5, 9, 12, 7, 20, 2], [1, 8, 8, 4, 29, 3, 11]]


class KeptLogs(logging.Handler):
    """(level, message) of each record it receives."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.kept: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.kept.append((record.levelno, record.getMessage()))


@contextlib.contextmanager
def training_logs() -> Iterator[list[tuple[int, str]]]:
    """What the training package logs in the block (a module fixture cannot take caplog)."""
    handler, logger = KeptLogs(), logging.getLogger("training")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.kept
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_model, storage_cfg):
    """Uninterrupted 1-worker run: train 1..3, publish v1, v2 and v3."""
    run = "ref1"
    write_rollouts(storage_cfg, run, range(1, 4))
    group = make_group(storage_cfg, run)
    out: dict = {"run": run, "metrics": []}
    try:
        with training_logs() as logged, ThreadPoolExecutor(2) as pool:
            # How a new run builds its trainer: ahead of train[1] on a thread, while
            # train[1]'s own ensure_state(0) may come in before that build ends.
            builds = list(pool.map(lambda _: group.ensure_state(0, tiny_model), range(2)))
        out["first_start_logs"], out["first_builds"] = logged, builds
        with pytest.raises(StateMismatchError, match=r"train_step\(2\) needs trainer state 1"):
            group.train(2)
        for k in (1, 2, 3):
            out["metrics"].append(group.train(k))
            out[f"summary{k}"] = group.export_hf(k, k, k - 1)
            out[f"v{k}"] = weight_shas(storage_cfg, run, k)
        out["probe_logprobs"] = ray.get(group.actors()[0].score.remote(PROBE))
        out["reexport"] = group.export_hf(3, 3, 2)
    finally:
        group.shutdown()
    return out


def test_train_metrics_and_sharded_export(reference):
    m = reference["metrics"][0]
    assert m["iteration"] == 1 and m["samples"] == 16 and m["tokens"] > m["response_tokens"] > 0
    for key in ("loss", "kl", "clip_frac", "grad_norm", "reward_mean", "train_s", "tokens_per_s"):
        assert math.isfinite(m[key]), key
    assert m["clip_frac"] == 0.0  # one optimizer step per iteration: ratio is 1 throughout
    assert m["kl"] == 0.0  # the reference is the base model, which step 1 starts from
    assert reference["metrics"][1]["kl"] > 0 and m["entropy"] > 0
    assert m["rollout_logprob_abs_diff"] > 0  # the synthetic engine logprobs are made up
    assert m["rollout_logprob_kl"] > 0 and m["rollout_correction_frac"] == 0.0  # off by default
    summary = reference["summary3"]
    assert summary["shards"] > 1  # shard_size 64 KiB splits the tiny model
    assert "model.safetensors.index.json" in summary["files"]
    assert summary["manifest"]["version"] == 3 and summary["manifest"]["parent"] == 2
    assert len({tuple(sorted(reference[f"v{k}"].items())) for k in (1, 2, 3)}) == 3
    assert reference["reexport"]["reused"] is True  # committed versions are not rewritten
    assert reference["reexport"]["manifest"] == summary["manifest"]


def test_export_loads_and_matches_trainer_logits(reference, storage_cfg):
    path = RunStore(storage_cfg, reference["run"]).local_version_dir(3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor(PROBE)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
    exported = logp.gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(exported, reference["probe_logprobs"], rtol=1e-5, atol=1e-5)


def _corrupt_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def test_kill_restore_replay_is_byte_identical(reference, tiny_model, storage_cfg, caplog):
    """Checkpoints 1 and 2 (2 corrupt), actors killed at state 3: ensure_state(3)
    reports the corrupt one in its result's warnings, restores 1, replays 2..3 and publishes the reference's bytes."""
    run = "rec1"
    write_rollouts(storage_cfg, run, range(1, 5))
    group = make_group(storage_cfg, run)
    try:
        group.create(tiny_model)
        for k in (1, 2):
            group.train(k)
            assert group.save(k, {"cursor": k})["iteration"] == k
        group.train(3)
        _corrupt_last_byte(f"{RunStore(storage_cfg, run).checkpoint_url(2)}/model.safetensors")
        for actor in group.actors():
            ray.kill(actor)
        assert not group.alive() and group.iteration() is None
        result = group.ensure_state(3, tiny_model)
        assert (result["restored_from"], result["replayed"]) == (1, [2, 3])
        # Ranks that ran and died: a real rebuild, so a WARNING (a first start is INFO).
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "train group rec1 holds None, needs 3: rebuilding" in warned
        assert result["recreated"] is True
        # The caller gets the fallback (a warning in a Ray worker's log reaches no user).
        [warning] = result["warnings"]
        assert re.search(
            r"checkpoint 2 of run 'rec1' is corrupt .*restored from checkpoint 1", warning
        )
        assert "replayed iterations 2..3" in warning
        # Normal path: alive and holding 3 -> nothing happens, nothing to warn about.
        again = group.ensure_state(3, tiny_model)
        assert again["recreated"] is False and again["warnings"] == []
        group.export_hf(3, 3, 2)
        assert weight_shas(storage_cfg, run, 3) == reference["v3"]
    finally:
        group.shutdown()
    assert not group.alive()


def test_a_first_start_logs_starting_and_no_warning(reference):
    """The reference run's trainer was built by ensure_state(0), as a new run's is:
    no fault, so INFO "starting" once, not a warning (a rebuild after a kill warns)."""
    logged = reference["first_start_logs"]
    assert logged.count((logging.INFO, "starting train group ref1 for state 0")) == 1
    assert [m for level, m in logged if level >= logging.WARNING] == []
    # Two callers at once (the build ahead and train[1]): one builds, the other waits.
    assert sorted(b["recreated"] for b in reference["first_builds"]) == [False, True]


def test_two_workers_fsdp_deterministic_and_recoverable(reference, tiny_model, storage_cfg):
    """FSDP2 over gloo: close to the 1-worker run, and byte-identical to itself
    after one rank is killed and the group restores + replays."""
    run = "fsdp2"
    write_rollouts(storage_cfg, run, range(1, 3))
    group = make_group(storage_cfg, run, workers=2)
    try:
        group.create(tiny_model)
        m1 = group.train(1)
        group.save(1)
        group.train(2)
        group.export_hf(2, 2, 1)
        uninterrupted = weight_shas(storage_cfg, run, 2)
        ray.kill(group.actors()[1])  # one rank dies; the group rebuilds both
        assert group.ensure_state(2, tiny_model) == {
            "restored_from": 1,
            "replayed": [2],
            "recreated": True,
            "warnings": [],
        }
        # v2 is committed; publish the replayed state as a separate version to compare.
        group.export_hf(102, 2, 1)
    finally:
        group.shutdown()
    assert weight_shas(storage_cfg, run, 102) == uninterrupted

    ref_m1 = reference["metrics"][0]
    assert m1["loss"] == pytest.approx(ref_m1["loss"], rel=1e-4, abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(ref_m1["grad_norm"], rel=1e-4)
    assert m1["response_tokens"] == ref_m1["response_tokens"]
    # Against the 1-worker run only closeness holds (another reduction order).
    ref = AutoModelForCausalLM.from_pretrained(
        RunStore(storage_cfg, reference["run"]).local_version_dir(2)
    )
    fsdp = AutoModelForCausalLM.from_pretrained(RunStore(storage_cfg, run).local_version_dir(2))
    for (name, p), q in zip(ref.state_dict().items(), fsdp.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)

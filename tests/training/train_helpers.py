"""Helpers for training tests: synthetic persisted rollouts and small groups.
(A uniquely named module, imported by name: tests/ has no packages.)"""

from __future__ import annotations

import random

from rollout.types import RolloutBatch, Sample
from storage.config import StorageConfig
from storage.run_store import RunStore
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.group import TrainGroup

VOCAB_LO, VOCAB_HI = 4, 30  # the tiny tokenizer's non-special ids


def synthetic_batch(k: int, prompts: int = 4, n: int = 4) -> RolloutBatch:
    """Rollouts of iteration k: random prompts/responses and 0/1 rewards, seeded by k."""
    rng = random.Random(1000 + k)
    samples = []
    for p in range(prompts):
        prompt = [1] + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(2, 6))]
        for j in range(n):
            resp = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(1, 8))] + [2]
            samples.append(
                Sample(
                    p, j, prompt, resp, [-3.0] * len(resp), float(rng.random() < 0.5), k - 1, "stop"
                )
            )
    return RolloutBatch(k, n, samples)


def write_rollouts(storage_cfg: StorageConfig, run: str, iterations: range) -> None:
    store = RunStore(storage_cfg, run)
    for k in iterations:
        store.write_rollouts(k, synthetic_batch(k).to_json())


def make_group(storage_cfg: StorageConfig, run: str, workers: int = 1) -> TrainGroup:
    # KL and entropy on, so the frozen reference model and the entropy gradient
    # are part of every determinism check.
    loss = {"kl_coef": 0.05, "entropy_coef": 0.01}
    cfg = TrainConfig(num_workers=workers, micro_batch_size=6, lr=1e-2, loss=loss)
    # A small shard size so export really produces several shards.
    weights = WeightsConfig(shard_size=64 * 1024)
    sections = TrainerSections(train=cfg, model=ModelConfig(), storage=storage_cfg, weights=weights)
    identity = RunIdentity(name=run, seed=7, namespace="prefect-rl")
    return TrainGroup(identity, sections, placement=None, fence=None)


def weight_shas(storage_cfg: StorageConfig, run: str, version: int) -> dict[str, str]:
    manifest = RunStore(storage_cfg, run).read_manifest(version)
    return {f.name: f.sha256 for f in manifest.files if f.name.endswith(".safetensors")}

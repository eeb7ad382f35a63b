"""megatron TP=2 over two GPUs (one train rank each, NCCL between them):

- logits of a Qwen2 (QKV bias, grouped KV heads) equal HF's, in float32 and
  bfloat16, on both ranks, each holding half of the sharded weights;
- one GRPO step (float32) gives the loss and gradient norm of the torch backend
  on one GPU: the norm sums TP-sharded gradients over the TP group;
- a colocated RL run: TP=2 checkpoints, tensor pushes, verified every iteration.

Run on nvidia-h200-x2: ``bash scripts/gpu2.sh`` (``pytest -m gpu -s`` prints the
measured differences).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
import torch

from tests.gpu2.two_gpu_runs import (
    NEEDS_TWO,
    check_pushed_equals_published,
    check_verified_every_iteration,
    device_of,
    engine_devices,
    kept_run,
)

pytestmark = [pytest.mark.gpu, NEEDS_TWO]
pytest.importorskip("megatron.core")

from mcore_helpers import tiny_model  # noqa: E402

SIZE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, vocab_size=1024)
IDS = torch.randint(0, SIZE["vocab_size"], (4, 96), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("qwen2-tp2")
    tiny_model("qwen2", **SIZE).save_pretrained(out)
    return str(out)


@contextmanager
def train_group(model_dir: str, root: str, backend: str, dtype: str, tp: int) -> Iterator:
    """A train group of ``tp`` ranks, a whole GPU each (TP=tp when megatron), built
    from ``model_dir``; shut down afterwards (the next one needs the GPUs)."""
    from storage.config import StorageConfig
    from training.config import (
        ModelConfig,
        RunIdentity,
        TrainConfig,
        TrainerSections,
        WeightsConfig,
    )
    from training.group import TrainGroup

    train = TrainConfig(
        backend=backend,
        num_workers=tp,
        num_gpus_per_worker=1.0,
        micro_batch_size=16,
        lr=1e-3,
        megatron={"tensor_parallel": tp},
    )
    sections = TrainerSections(
        train=train,
        model=ModelConfig(dtype=dtype),
        storage=StorageConfig(root=root),
        weights=WeightsConfig(),
    )
    group = TrainGroup(
        RunIdentity(name=f"tp2-{backend}", seed=0, namespace="prefect-rl"),
        sections,
        placement=None,
        fence=None,
    )
    try:
        group.create(model_dir)
        yield group
    finally:
        group.shutdown()


def rank_logits(group) -> list[tuple[torch.Tensor, int, int]]:
    """(full-vocab logits of IDS, parameters held, TP size) of every rank; the forward
    is a TP collective, so every rank is asked at once."""

    def forward(actor, ids: torch.Tensor):
        import torch

        with torch.no_grad():
            logits = actor.model(input_ids=ids.to(actor.device)).logits.float().cpu()
        return logits, sum(p.numel() for p in actor.model.parameters()), actor.tp

    return ray.get([a.__ray_call__.remote(forward, IDS) for a in group.actors()])


def hf_logits(model_dir: str, dtype: str) -> tuple[torch.Tensor, int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    hf = hf.to("cuda").eval()
    with torch.no_grad():
        ref = hf(input_ids=IDS.to("cuda")).logits.float().cpu()
    return ref, sum(p.numel() for p in hf.parameters())


def check_parity(group, model_dir: str, dtype: str) -> None:
    ref, full_params = hf_logits(model_dir, dtype)
    (a, held_a, tp_a), (b, held_b, tp_b) = rank_logits(group)
    diff = (a - ref).abs()
    scale = max(ref.abs().max().item(), 1.0)
    print(
        f"\nTP2 PARITY qwen2 {dtype}: max_abs_diff={diff.max().item():.3e} "
        f"mean_abs_diff={diff.mean().item():.3e} max|logit|={scale:.3f}; "
        f"params per rank {held_a}/{held_b} of {full_params}"
    )
    assert tp_a == tp_b == 2
    assert held_a < full_params and held_b < full_params  # each rank holds its shards only
    assert torch.equal(a, b)  # full-vocab logits on every rank (parallel_output=False)
    tol = 6e-2 if dtype == "bfloat16" else 1e-4
    assert diff.max().item() < tol * scale


def test_tp2_bfloat16_logits_match_hf(ray_cluster, qwen2_dir, tmp_path):
    with train_group(qwen2_dir, str(tmp_path), "megatron", "bfloat16", 2) as group:
        check_parity(group, qwen2_dir, "bfloat16")


def test_tp2_float32_logits_and_grpo_step_match(ray_cluster, qwen2_dir, tmp_path):
    from storage.config import StorageConfig
    from tests.training.train_helpers import write_rollouts

    storage = StorageConfig(root=str(tmp_path))
    for run in ("tp2-megatron", "tp2-torch"):  # the same rollouts for both backends
        write_rollouts(storage, run, range(1, 2))
    with train_group(qwen2_dir, str(tmp_path), "megatron", "float32", 2) as group:
        check_parity(group, qwen2_dir, "float32")
        tp2 = group.train(1)
    with train_group(qwen2_dir, str(tmp_path), "torch", "float32", 1) as group:
        ref = group.train(1)
    print(
        f"\nTP2 GRPO STEP float32: megatron loss={tp2['loss']:.6f} grad_norm={tp2['grad_norm']:.6f}; "
        f"torch (1 GPU) loss={ref['loss']:.6f} grad_norm={ref['grad_norm']:.6f}"
    )
    assert tp2["loss"] == pytest.approx(ref["loss"], abs=1e-4)
    assert tp2["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)


def test_tp2_megatron_rl_run(ray_cluster, tmp_path):
    with kept_run("megatron-tp2", str(tmp_path / "runs")) as (ctx, rows):
        check_verified_every_iteration(ctx, rows, engines=1)
        assert ctx.store.committed_checkpoints() == [1, 2]
        train_devs = [device_of(a) for a in ctx.trainer().actors()]
        engine = engine_devices(ctx.engines().handle(0))
        print(f"devices: train ranks {train_devs}, engine {engine}")
        assert len(set(train_devs)) == 2 and engine == train_devs[:1]
        check_pushed_equals_published(ctx, 0, 2)

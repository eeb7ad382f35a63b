"""The tiny-config RL run with ``train.backend: megatron`` on real Ray actors and a GPU:
rollout, train, save, publish, reload, verify; then a restore from a checkpoint."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_tiny_rl_run_with_megatron_backend(ray_cluster, tmp_path):
    # The session cluster (tests/conftest.py) holds every GPU: a second ray.init in one
    # `pytest -m gpu` session would fail with "called ray.init twice".
    from flows.config import load_config
    from flows.driver import run_plain

    def cfg(iterations: int):
        return load_config(
            None,
            {
                "run.name": "megatron-tiny",
                "run.iterations": iterations,
                "run.save_interval": 1,
                "storage.root": str(tmp_path / "runs"),
                "rollout.batch_size": 4,
                "rollout.n_samples_per_prompt": 4,
                "train.backend": "megatron",
                # Half the GPU, as a user sharing it with an engine would ask: in one
                # `pytest -m gpu` run a whole GPU was not free (seen 2026-12-03).
                "train.num_gpus_per_worker": 0.5,
                "model.dtype": "bfloat16",
                "tasks.retry_delay_s": [0.1],
            },
        )

    from tasks import steps

    # The actors stay up for the check: after run_plain's shutdown, verify_engine would
    # start a fresh engine that no one stops.
    ctx, rows, secs = run_plain(cfg(2), quiet=True, keep_actors=True)
    try:
        print(f"\nRL RUN megatron: {len(rows)} iterations in {secs:.1f}s")
        for r in rows:
            print({k: r.get(k) for k in ("iteration", "loss", "reward_mean", "train_tokens_per_s")})
        assert [r["iteration"] for r in rows] == [1, 2]
        assert ctx.store.committed_versions() == [0, 1, 2]
        assert ctx.store.committed_checkpoints() == [1, 2]
        # run_plain raises VersionMismatch if verify fails; check once more, explicitly
        assert steps.verify_engine(ctx, 2, 0)["verified"] is True
    finally:
        # kill the train ranks: iteration 3 must restore checkpoint 2 through the megatron loader
        ctx.trainer().shutdown()
        ctx.engines().shutdown()
    ctx3, rows3, _ = run_plain(cfg(3), quiet=True)
    assert [r["iteration"] for r in rows3] == [3]
    assert ctx3.store.committed_versions() == [0, 1, 2, 3]
    print("RL RUN resume after release:", {k: rows3[0].get(k) for k in ("iteration", "loss")})

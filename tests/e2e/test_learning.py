"""It learns: on the default config the mean reward of the last 5 iterations is
at least twice that of the first 5 (fixed seed; CPU runs are deterministic)."""

import pytest

from flows.config import load_config
from flows.driver import run_plain


@pytest.mark.slow
def test_reward_goes_up_on_the_default_task(ray_cluster, tmp_path):
    cfg = load_config("configs/tiny-cpu.yaml", {"storage.root": str(tmp_path), "run.name": "learn"})
    ctx, rows, _ = run_plain(cfg, quiet=True)
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == cfg.run.iterations == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first > 0, "a random policy scores above zero on this task"
    assert last >= 2 * first, f"reward did not double: first 5 {first:.3f}, last 5 {last:.3f}"
    # every iteration was verified: each engine serves the final version
    assert ctx.store.serving_versions() == {0: 20}

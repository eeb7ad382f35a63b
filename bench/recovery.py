"""Recovery time: from a killed train actor to training going again, against
the time to load the checkpoint alone.

A tiny run trains 4 iterations (checkpoints at 2 and 4). Then, 3 times each:
- kill rank 0, ``ensure_state(4)`` (recreate the actors and placement group,
  restore checkpoint 4), then one train step: the whole recovery;
- kill rank 0, ``ensure_state(3)`` (restore checkpoint 2, replay iteration 3
  over its persisted rollouts): recovery with one replayed step;
- baseline: ``load_checkpoint(4)`` on live actors (what restoring costs alone).

    .venv/bin/python -m bench.recovery
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main() -> None:
    from flows.config import load_config
    from flows.driver import run_plain

    root = tempfile.mkdtemp(prefix="bench-recovery-")
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        {
            "run.name": "bench-rec",
            "storage.root": root,
            "run.iterations": 4,
            "run.save_interval": 2,
        },
    )
    ctx, _, _ = run_plain(cfg, quiet=True, keep_actors=True)  # the bench kills and restores them
    trainer, base = ctx.trainer(), ctx.base_model_path
    ctx.store.write_rollouts(5, ctx.store.read_rollouts(4))  # a step to run after recovery

    def kill() -> None:
        ray.kill(trainer.actors()[0], no_restart=True)

    recover, replay, load = [], [], []
    for _ in range(3):
        kill()
        t0 = time.perf_counter()
        trainer.ensure_state(4, base)
        trainer.train(5)
        recover.append(time.perf_counter() - t0)
        kill()
        t0 = time.perf_counter()
        trainer.ensure_state(3, base)
        replay.append(time.perf_counter() - t0)
        trainer.ensure_state(4, base)
        t0 = time.perf_counter()
        ray.get([a.load_checkpoint.remote(4) for a in trainer.actors()])
        load.append(time.perf_counter() - t0)
    row = {
        "recover_and_train_s": statistics.median(recover),
        "recover_with_replay_s": statistics.median(replay),
        "load_checkpoint_s": statistics.median(load),
    }
    row["ratio"] = row["recover_and_train_s"] / row["load_checkpoint_s"]
    print("| operation (tiny config, median of 3) | seconds |\n|---|---|")
    print(
        f"| kill rank 0 -> actors recreated, checkpoint 4 restored, one train step | {row['recover_and_train_s']:.2f} |"
    )
    print(
        f"| kill rank 0 -> checkpoint 2 restored + iteration 3 replayed | {row['recover_with_replay_s']:.2f} |"
    )
    print(f"| baseline: load_checkpoint(4) on live actors | {row['load_checkpoint_s']:.3f} |")
    print(f"| ratio recovery / checkpoint load | {row['ratio']:.1f}x |")
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/recovery.json").write_text(json.dumps(row, indent=2))
    trainer.shutdown()
    ctx.engines().shutdown()


if __name__ == "__main__":
    main()

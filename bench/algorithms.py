"""Each policy-gradient algorithm on the default task, once: does it learn, and
what an iteration costs.

One run per algorithm of ``configs/tiny-cpu.yaml`` (20 iterations, seed 0, the
embedded engine and one CPU train rank) with only the algorithm's keys changed
(``ALGORITHMS``). Prints one table, from this one run of each:

    algorithm | reward first 5 -> last 5 | seconds per iteration

Seconds per iteration is the run's wall time over its iterations (the first
includes building the actors). ``tests/e2e/test_algorithms.py`` runs the same
settings and asserts that each learns. The rewards per iteration go to
``bench/results/algorithms.json``.

    .venv/bin/python -m bench.algorithms [name ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

BASE = "configs/tiny-cpu.yaml"
# The keys each algorithm changes in the default config.
ALGORITHMS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "gspo": {"train.loss.kind": "gspo"},
    "dapo": {
        "train.loss.kind": "dapo",
        "train.loss.clip_eps_low": 0.2,
        "train.loss.clip_eps_high": 0.28,
        "rollout.dynamic_sampling.enabled": True,
        "rollout.dynamic_sampling.max_rounds": 3,
    },
    "reinforce_pp": {"train.loss.advantage": "reinforce_pp"},
    "ppo": {"train.loss.advantage": "gae"},
}


def first_last(rewards: list[float]) -> tuple[float, float]:
    """Mean reward of the first 5 and of the last 5 iterations."""
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


def run(name: str, root: str, **extra: Any) -> tuple[list[dict[str, Any]], float]:
    """One plain run of algorithm ``name`` under ``root``: its metrics rows and seconds."""
    from flows.config import load_config
    from flows.driver import run_plain

    over = {"storage.root": root, "run.name": f"algo-{name}", **ALGORITHMS[name], **extra}
    _, rows, seconds = run_plain(load_config(BASE, over), quiet=True)
    return rows, seconds


def main(names: list[str]) -> None:
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    root = tempfile.mkdtemp(prefix="bench-algorithms-")
    lines = ["| algorithm | reward first 5 -> last 5 | seconds per iteration |", "|---|---|---|"]
    results = []
    for name in names:
        rows, seconds = run(name, root)
        rewards = [r["reward_mean"] for r in rows]
        first, last = first_last(rewards)
        per_iter = seconds / len(rows)
        lines.append(f"| {name} | {first:.3f} -> {last:.3f} | {per_iter:.2f} |")
        print(lines[-1], flush=True)
        keys = ALGORITHMS[name]
        results.append(
            {"algorithm": name, "overrides": keys, "rewards": rewards, "s_per_iter": per_iter}
        )
    print("\n".join(lines))
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/algorithms.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:] or list(ALGORITHMS))

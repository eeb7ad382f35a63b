"""The project's reward as verl's ``compute_score``, for ``bench.peers.verl_grpo``.

verl loads this file by its path (``reward.custom_reward_function.path``) in its
reward workers, and calls ``compute_score`` on each decoded answer (special tokens
skipped, as the project decodes). Each dataset row's ``extra_info`` names the
reward (``rollout.reward``, and its trusted modules joined by commas) and the evaluation's pass threshold;
``acc`` (reward >= threshold) is what verl's validation averages into its
``val-core/<task>/acc/mean@1``: greedy pass@1 on the held-out prompts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # verl imports this file by path, from a Ray worker
    sys.path.insert(0, _ROOT)

from rollout.rewards import load_reward  # noqa: E402


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **_: Any,
) -> dict[str, float]:
    info = extra_info or {}
    trusted = [m for m in str(info.get("trusted") or "").split(",") if m]
    fn = load_reward(info["reward"], trusted)
    reward = float(fn(solution_str, str(ground_truth)))
    return {"score": reward, "acc": float(reward >= float(info["pass_threshold"]))}

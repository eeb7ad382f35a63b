"""A reward for the evaluate-versions tests: ``match`` that fails once for a chosen
label. The test writes a marker file named by the label's sha256 into ``FAULTS``;
the first scoring of that label (in whichever Ray worker scores its shard)
removes the marker and raises, so exactly the shard holding the label fails
once, and its retry scores normally. A real fault of the reward, not a mock."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from rollout.rewards import match_reward

FAULTS = Path(tempfile.gettempdir()) / f"prefect-rl-eval-faults-{os.getuid()}"


def marker(label: str) -> Path:
    return FAULTS / hashlib.sha256(label.encode()).hexdigest()


def match_failing_once(response: str, label: str) -> float:
    try:
        marker(label).unlink()
    except FileNotFoundError:
        return match_reward(response, label)
    raise RuntimeError(
        f"injected reward failure for label {label!r} (tests/integration/eval_rewards.py)"
    )

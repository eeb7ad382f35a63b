"""A reward for the evaluate-versions tests that fails once for a chosen label.

The score is a function of every character of the answer (a byte of its sha256,
in quarters): about half of a random model's answers pass a 0.5 threshold, and
a changed answer changes its score with probability 3/4, so equal pass rates
over many answers mean equal answers. The test writes a marker file named by a
label's sha256 into ``FAULTS`` (the test session's own folder); the first scoring of that label (in whichever
Ray worker scores its shard) removes the marker and raises, so exactly the
shard holding the label fails once, and its retry scores normally. A real
fault of the reward, not a mock."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

# The test session's own folder (tests/conftest.py sets it before Ray starts, so the
# workers that score shards inherit it); a per-user one outside a test session.
FAULTS = Path(
    os.environ.get("PREFECT_RL_EVAL_FAULTS")
    or Path(tempfile.gettempdir()) / f"prefect-rl-eval-faults-{os.getuid()}"
)


def marker(label: str) -> Path:
    return FAULTS / hashlib.sha256(label.encode()).hexdigest()


def digest_failing_once(response: str, label: str) -> float:
    try:
        marker(label).unlink()
    except FileNotFoundError:
        return (hashlib.sha256(response.encode()).digest()[0] % 4) / 3
    raise RuntimeError(
        f"injected reward failure for label {label!r} (tests/integration/eval_rewards.py)"
    )

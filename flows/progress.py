"""Console progress lines and the end-of-run summary (no Prefect, no Ray)."""

from __future__ import annotations

import shlex
from typing import Any


def _f(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _mb(n: int | None) -> str:
    return "" if n is None else f" ({n / 1e6:.1f} MB)"


def iteration_line(row: dict[str, Any], total: int) -> str:
    return (
        f"[iter {row['iteration']:>3}/{total}] reward={_f(row.get('reward_mean'))} "
        f"loss={_f(row.get('loss'), '.4f')} kl={_f(row.get('kl'), '.4f')} "
        f"gen={_f(row.get('gen_tokens_per_s'), '.0f')} tok/s train={_f(row.get('train_tokens_per_s'), '.0f')} tok/s "
        f"publish={_f(row.get('publish_s'), '.2f')}s reload={_f(row.get('reload_s'), '.2f')}s"
        f"{_mb(row.get('sync_bytes'))} "
        f"sample={row.get('example', '')!r}"
    )


def summary(rows: list[dict[str, Any]], store_url: str, versions: list[int], seconds: float) -> str:
    if not rows:
        newest = f", newest version v{versions[-1]}" if versions else ""
        return f"nothing to do: run at {store_url} is complete ({len(versions)} versions committed{newest})"
    rewards = [r["reward_mean"] for r in rows]
    head, tail = rewards[:5], rewards[-5:]
    return "\n".join(
        [
            f"run finished: {len(rows)} iterations in {seconds:.1f}s ({seconds / len(rows):.2f}s/iteration)",
            f"  reward: first {len(head)} mean {sum(head) / len(head):.3f} -> last {len(tail)} mean {sum(tail) / len(tail):.3f}",
            f"  weights: v{versions[0]}..v{versions[-1]} committed under {store_url}/weights"
            if versions
            else "",
            f"  metrics: {store_url}/metrics.jsonl",
        ]
    )


def continue_hint(config: str, sets: list[str], committed: int, plain: bool = False) -> str:
    """How to continue the run past its ``committed`` iterations: the same command
    with run.iterations raised (the user's other --set kept), or the deployment."""
    kept = [s for s in sets if not s.replace(" ", "").startswith("run.iterations=")]
    more = committed + 10
    args = "".join(f" --set {shlex.quote(s)}" for s in kept) + f" --set run.iterations={more}"
    flag = " --plain" if plain else ""
    return (
        f"{committed} iterations committed. To continue to {more}: "
        f"prefect-rl run {config}{args}{flag} "
        "(from Prefect: the rl-training deployment with --param extra_iterations=10)"
    )

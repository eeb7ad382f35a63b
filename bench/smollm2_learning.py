"""SmolLM2-135M-Instruct learning 2-digit addition: reward and held-out pass@1 per iteration.

Runs ``configs/smollm2-cpu.yaml`` (or ``--config``) for ``--iterations`` with the
plain driver in a fresh storage root, then prints one line per iteration (the
batch's mean reward, the held-out greedy and sampled pass@1 where evaluated
(``eval.interval``: the same held-out prompts each time), an example answer)
and the CPU goal beside the figures it reads:

    mean reward of the last 5 iterations > mean reward of the first 5

The base model (v0) is evaluated before training on the same engines and held-out
prompts (``eval.before_training``: ledger record ``iter_0/evaluate``), and the GPU
goal is read beside it: the last held-out greedy pass@1 at least 2x
the base model's. Needs the model imported once:

    .venv/bin/prefect-rl import-model smollm2-135m-instruct
    .venv/bin/python -m bench.smollm2_learning --iterations 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


PACKAGES = ("torch", "transformers", "sglang", "ray", "prefect")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/smollm2-cpu.yaml")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="write the rows and walls as JSON here")
    args = parser.parse_args()

    from bench.peers.task import commit, machine, versions
    from flows.config import load_config, parse_override
    from flows.driver import run_plain

    root = tempfile.mkdtemp(prefix="bench-smollm2-")
    overrides = dict(parse_override(s) for s in args.set)
    overrides.update({"storage.root": root, "run.iterations": args.iterations})
    cfg = load_config(args.config, overrides)
    print(f"config {args.config}, {args.iterations} iterations, storage {root}")
    t0 = time.perf_counter()
    ctx, rows, seconds = run_plain(cfg, quiet=False)
    walls = iteration_walls(ctx, [r["iteration"] for r in rows])
    print(
        f"{'k':>3} {'reward':>7} {'pass@1 greedy':>14} {'pass@1 sampled':>15} "
        f"{'kl(engine||trainer)':>19} {'train tok/s':>11} {'wall s':>6}  example"
    )
    base = base_evaluation(ctx)
    if base is not None:
        print(
            f"{0:>3} {'':>7} {base['pass_at_1_greedy']:>14.3f} {base['pass_at_1']:>15.3f}  (base)"
        )
    for r, wall in zip(rows, walls):
        greedy, sampled = r.get("eval_pass_at_1_greedy"), r.get("eval_pass_at_1")
        kl = r.get("rollout_logprob_kl")
        print(
            f"{r['iteration']:>3} {r['reward_mean']:>7.3f} "
            f"{'' if greedy is None else f'{greedy:.3f}':>14} "
            f"{'' if sampled is None else f'{sampled:.3f}':>15} "
            f"{'' if kl is None else f'{kl:.2e}':>19} "
            f"{r.get('train_tokens_per_s') or 0:>11.0f} {wall:>6.2f}  "
            f"{(r.get('example') or '')[:40]!r}"
        )
    kls = [r["rollout_logprob_kl"] for r in rows if r.get("rollout_logprob_kl") is not None]
    if kls:
        print(f"rollout_logprob_kl: median {statistics.median(kls):.5f}, max {max(kls):.5f}")
    steady = walls[1:] or walls
    print(
        f"iteration wall: median {statistics.median(steady):.2f} s after the first; "
        f"train tokens/s median "
        f"{statistics.median(r.get('train_tokens_per_s') or 0 for r in rows):.0f}"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "config": args.config,
                    "set": args.set,
                    # what bench.peers.compare names beside each system's figures
                    "commit": commit(),
                    "machine": machine(),
                    "versions": versions(PACKAGES),
                    "base": base,
                    "walls": walls,
                    "rows": rows,
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
    rewards = [r["reward_mean"] for r in rows]
    n = min(5, len(rewards) // 2) or 1
    first, last = statistics.mean(rewards[:n]), statistics.mean(rewards[-n:])
    verdict = "met" if last > first else "NOT met"
    print(f"reward: first {n} mean {first:.3f}, last {n} mean {last:.3f} ({verdict})")
    greedy = [
        r["eval_pass_at_1_greedy"] for r in rows if r.get("eval_pass_at_1_greedy") is not None
    ]
    if base is not None and greedy:
        b, e = base["pass_at_1_greedy"], greedy[-1]
        ratio = e / b if b else (float("inf") if e else 0.0)
        print(
            f"held-out greedy pass@1: base model (v0) {b:.3f}, last evaluation {e:.3f} "
            f"({ratio:.2f}x; goal >= 2x: {'met' if ratio >= 2 else 'NOT met'}); "
            f"base sampled pass@1 {base['pass_at_1']:.3f}"
        )
    print(f"wall {time.perf_counter() - t0:.0f} s ({seconds:.0f} s in iterations)")


def iteration_walls(ctx, iterations: list[int]) -> list[float]:
    """Seconds between the commits of consecutive iterations (the first: from its
    rollout's start, engine start excluded)."""
    from datetime import datetime

    def at(k: int, step: str) -> float:
        record = ctx.store.read_record(k, step)
        return datetime.fromisoformat(record["committed_at"]).timestamp()

    walls = []
    for k in iterations:
        end = at(k, "iteration")
        start = (
            at(k - 1, "iteration")
            if k > 1
            else at(k, "rollout") - ctx.store.read_record(k, "rollout")["seconds"]
        )
        walls.append(end - start)
    return walls


def base_evaluation(ctx) -> dict | None:
    """The base model's evaluation (``eval.before_training``: the ledger record of
    ``evaluate[0]``, run before iteration 1's rollout); None when there is none."""
    record = ctx.store.read_record(0, "evaluate")
    return None if record is None else record["result"]


if __name__ == "__main__":
    main()

"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2): a group whose
rewards are all equal has zero advantage under every group baseline, so it
spends a batch slot on no gradient. Such groups are dropped and more prompts
are generated, round after round, until the batch holds ``rollout.batch_size``
groups or ``rollout.dynamic_sampling.max_rounds`` rounds ran. A later round asks
the gap divided by the share of groups kept so far (``ask``), at most one batch:
asking only the gap would leave a batch short after every round while groups
are dropped at the same rate (SmolLM2 on the H100: all 4 rounds for every batch),
and each round has a cost of its own beside its prompts' (the three later rounds
there, each a fraction of a batch, took about a third of the full first round's
time each). Peers over-sample the same way, by a fixed
factor (verl's ``gen_batch_size``, slime's ``over_sampling_batch_size``); the
batch's own keep rate follows the policy as it learns.

Owns (its setting is ``rollout.config.DynamicSamplingConfig``) which prompts a later round asks
(``extra_prompts``: a function of (seed, k, round), disjoint from every
iteration's regular prompts, so a retried rollout regenerates the same batch)
and the filling itself (``fill``). The rollout procedure calls ``fill`` once,
after its first round, through one marked hook. The batch records what
happened (``RolloutBatch.sampling``), and the persisted batch is what a retried
rollout step reuses.

What it leaves out: the paper keeps sampling until the batch is full; here the
rounds are bounded, and a batch still short after the last round is filled with
the dropped groups in the order they came (counted in ``filled_uniform``), so
every batch has the same size (equal rows per train rank). Imports no Prefect,
Ray or engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from rollout.types import Generated, Prompt, RolloutBatch, Sample, SamplingRecord

if TYPE_CHECKING:
    from rollout.config import RolloutConfig

# Later rounds ask prompts from index 2**40 on: builtin tasks and dataset
# epochs derive a prompt from its index, and regular batches never get there.
EXTRA_INDEX_BASE = 1 << 40


def extra_prompts(source, k: int, round_: int, count: int, batch_size: int) -> list[Prompt]:
    """The ``count`` prompts of round ``round_`` (>= 1) of iteration k: indices of
    their own, one block of ``batch_size`` per (k, round), so no two rounds or
    iterations share a prompt index (nor a sampling seed)."""
    if not 1 <= count <= batch_size:
        raise ValueError(f"a round asks 1..{batch_size} prompts, not {count}")
    start = EXTRA_INDEX_BASE + ((k - 1) * 1024 + round_) * batch_size
    return source.prompts(range(start, start + count))


def ask(need: int, kept: int, asked: int, batch_size: int) -> int:
    """Prompts the next round asks for ``need`` more informative groups when
    ``kept`` of the ``asked`` groups so far were kept: the gap over the keep rate,
    rounded up, at most ``batch_size`` (one round's block of prompt indices); a
    full batch when none was kept."""
    if kept == 0:
        return batch_size
    return min(batch_size, -(-need * asked // kept))


def groups(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Samples cut into their prompts' groups (each prompt's n samples are contiguous)."""
    return [samples[i : i + n] for i in range(0, len(samples), n)]


def informative(group: list[Sample]) -> bool:
    """True when the group's rewards differ: it carries a gradient."""
    return len({s.reward for s in group}) > 1


def counts(batch: RolloutBatch) -> dict[str, Any] | None:
    """The rollout step's ledger entry of what dynamic sampling did (None when off)."""
    return None if batch.sampling is None else asdict(batch.sampling)


def sampling_row_fields(sampling: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics row's dynamic-sampling columns from the rollout's ``sampling`` entry
    ({} when off): the reward of everything generated beside the kept batch's
    ``reward_mean``, which filtering lifts (DAPO's runs log both)."""
    if not sampling:
        return {}
    return {
        "reward_mean_generated": sampling.get("reward_mean_generated"),
        "sampling_rounds": sampling["rounds"],
    }


def fill(
    cfg: RolloutConfig,
    source,
    k: int,
    first: Generated,
    generate: Callable[[list[Prompt]], Generated],
) -> Generated:
    """Rollout k with dynamic sampling, from its first round ``first``;
    ``generate(prompts)`` runs one more round. Off (the default): ``first``."""
    ds = cfg.dynamic_sampling
    if not ds.enabled:
        return first
    n, size = cfg.n_samples_per_prompt, cfg.batch_size
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    gen_s, rounds, asked, reward_sum = 0.0, 0, 0, 0.0
    out = first
    while True:
        gen_s += out.gen_s
        rounds += 1
        reward_sum += sum(out.batch.rewards)
        for g in groups(out.batch.samples, n):
            asked += 1
            (kept if informative(g) else dropped).append(g)
        need = size - len(kept)
        if need <= 0 or rounds >= ds.max_rounds:
            break
        more = ask(need, len(kept), asked, size)
        out = generate(extra_prompts(source, k, rounds, more, size))
    # Dropped groups fill what the rounds left short, oldest first.
    filled = max(size - len(kept), 0)
    chosen = (kept + dropped[:filled])[:size]
    record = SamplingRecord(
        rounds=rounds,
        prompts=asked,
        dropped_groups=len(dropped),
        filled_uniform=filled,
        reward_mean_generated=reward_sum / (asked * n),
        unused_groups=max(len(kept) - size, 0),
    )
    samples = [s for g in chosen for s in g]
    batch = RolloutBatch(
        iteration=k,
        n_samples_per_prompt=n,
        samples=samples,
        sampling=record,
        temperature=first.batch.temperature,
    )
    return replace(first, batch=batch, gen_s=gen_s)

"""A persisted rollout that training cannot use, and how to make it again.

A rollout batch is persisted once and reused by every retry and rerun (the
ledger's record and Prefect's cached result of ``rollout[k]`` both say it is
done), so a batch whose rewards give NaN advantages fails ``train[k]`` for
good unless all three are removed. ``named_if_unusable`` turns the trainer's
``UnusableRollout`` into an error that names the file, where its rewards came
from and what to delete. No Prefect import: only the results folder's name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from storage.layout import iter_name
from training.types import UnusableRollout


def regenerate_hint(ctx, k: int) -> str:
    """What to delete so that ``rollout[k]`` runs again: the batch, its ledger record and
    Prefect's cached result (``flows.iteration.result_storage``, key ``{run}/{k}/rollout``)."""
    it = iter_name(k)
    return (
        f"in the run folder {ctx.store.url} delete rollouts/{it}.json, ledger/{it}/rollout.json "
        f"and, if the run ran under Prefect, prefect-results/{ctx.run_name}/{k}/rollout; then "
        f"rerun: rollout[k={k}] is generated again"
    )


@contextmanager
def named_if_unusable(ctx, k: int) -> Iterator[None]:
    """Re-raise the trainer's UnusableRollout for rollout k with the file and the way out."""
    try:
        yield
    except UnusableRollout as e:
        why = getattr(e, "cause", e)  # a Ray task error: the actor's own exception
        raise UnusableRollout(
            f"train[k={k}] cannot use the persisted rollouts {ctx.store.rollouts_url(k)}: {why}. "
            f"Their rewards came from rollout.reward {ctx.cfg.rollout.reward!r}: fix it, then "
            + regenerate_hint(ctx, k)
        ) from None

"""Which weights generate which batch: a function of the config, never of timing.

With ``rollout.max_staleness`` N, batch k is generated on v(k-1-N), never
before the base model v0, so the first N+1 batches come from v0 and iteration k
makes batch k+N while train[k] runs. With ``rollout.partial`` a batch k > N is
made in two chunks (``rollout.partial``): its head on v(k-1-N), the rest on
v(k-N), once publish[k-N] and the reload of iteration k-N are done. A resumed
run asks the same questions and gets the same answers, which is what keeps it
byte-identical. Reads the config only: no storage, no engines, no Prefect.
"""

from __future__ import annotations

__all__ = ["continue_source", "made_on", "rollout_source"]


def rollout_source(ctx, k: int) -> int:
    """The iteration whose weights generate rollout k (with ``rollout.partial``: its
    head): k-1 on-policy, k-1-N with ``rollout.max_staleness`` N, never below 0."""
    return max(k - 1 - ctx.cfg.rollout.max_staleness, 0)


def continue_source(ctx, k: int) -> int | None:
    """With ``rollout.partial``, the iteration whose weights continue batch k after its
    head: one newer than ``rollout_source``. None: batch k is made whole on one
    version (partial is off, or k <= N, where both would be v0)."""
    if not ctx.cfg.rollout.partial:
        return None
    later = k - ctx.cfg.rollout.max_staleness
    return later if later >= 1 else None


def made_on(ctx, k: int) -> int:
    """The iteration whose weights the rollout step of batch k generates on, and so the
    newest version in batch k: with ``rollout.partial``, the continuation's (its head
    is on ``rollout_source``)."""
    later = continue_source(ctx, k)
    return rollout_source(ctx, k) if later is None else later

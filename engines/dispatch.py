"""Rollout dispatch: which engine decodes which rows, and a dead engine's share again.

``generate_groups`` (and ``generate_rows``) give each engine a fixed share of the
groups as one call, so what an engine decodes together is decided by the request,
never by timing; a dead engine's share is regenerated whole after its restart.
``EngineGroup`` (``engines.group``) takes these methods; they need only its
handles, names, restart and deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from actors import deadline
from engines.types import EngineDeadError, GenerateResult

RestartFn = Callable[[int], None]


class RolloutDispatch:
    """The rollout half of ``EngineGroup``: rows to engines, results back in order."""

    # Given by EngineGroup: handles(), handle(i), actor_name(i), _default_restart(i).
    call_timeout_s: float | None  # the deadline of each wait on engines; None: none

    def generate_groups(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: dict[str, Any],
        seeds: list[list[int]],
        restart_fn: RestartFn | None = None,
        max_restarts: int = 2,
    ) -> list[list[GenerateResult]]:
        """``n`` samples per prompt, in prompt order; ``seeds[g][j]``: sample j of
        prompt g's sampling_seed. Dispatch and restarts: ``generate_rows``."""
        if len(seeds) != len(prompts) or any(len(s) != n for s in seeds):
            raise ValueError("seeds must hold n seeds for each prompt")
        rows = [[p] * n for p in prompts]
        params = [[dict(sampling, sampling_seed=int(s)) for s in row] for row in seeds]
        return self.generate_rows(rows, params, restart_fn, max_restarts)

    def generate_rows(
        self,
        rows: list[list[list[int]]],
        params: list[list[dict[str, Any]]],
        restart_fn: RestartFn | None = None,
        max_restarts: int = 2,
    ) -> list[list[GenerateResult]]:
        """Generate each of group g's rows ``rows[g]`` with its ``params[g]`` entry
        (a partial rollout's continuation: a sample's prompt and its tokens so far).
        Group g goes to engine ``g % engines`` (index order) in that engine's one
        call, never decoded with another call's rows: the result is a function of
        the request and the weights, not of timing. A dead engine is restarted
        (``restart_fn(i)``) at most ``max_restarts`` times and its share sent again
        whole, so no group mixes versions; CallTimeout after ``call_timeout_s``."""
        if len(params) != len(rows) or any(len(p) != len(r) for p, r in zip(params, rows)):
            raise ValueError("params must hold one dict for each row")
        restart = restart_fn or self._default_restart
        engines = self.handles()
        if not engines:
            raise RuntimeError(f"no engines of run {self.run_name!r} exist: call start() first")
        order = sorted(engines)
        shares = {i: list(range(pos, len(rows), len(order))) for pos, i in enumerate(order)}
        restarts = {i: 0 for i in order}
        results: list[list[GenerateResult]] = [[] for _ in rows]
        clock = deadline.Deadline(self.call_timeout_s)

        def send(i: int) -> ray.ObjectRef:
            share = shares[i]
            flat = [row for g in share for row in rows[g]]
            return engines[i].generate.remote(flat, [p for g in share for p in params[g]])

        inflight = {send(i): i for i in order if any(rows[g] for g in shares[i])}
        while inflight:
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=clock.remaining())
            if not done:  # the deadline passed with every call still waiting
                waiting = [self.actor_name(e) for e in inflight.values()]
                raise clock.expired(waiting, f"generate ({len(inflight)} engine shares waiting)")
            i = inflight.pop(done[0])
            try:
                out = ray.get(done[0])
            except (RayActorError, EngineDeadError):  # the actor, or its decode loop, died
                restarts[i] += 1
                if restarts[i] > max_restarts:
                    raise
                restart(i)
                engines[i] = self._require(i)
                inflight[send(i)] = i  # the whole share again, on the restarted engine
                continue
            start = 0  # the share's rows, back into their groups
            for g in shares[i]:
                results[g] = out[start : start + len(rows[g])]
                start += len(rows[g])
        return results

    def _require(self, i: int) -> ActorHandle:
        h = self.handle(i)
        if h is None:
            raise RuntimeError(f"{self.actor_name(i)} is missing after its restart")
        return h

"""Rollout dispatch: which engine decodes which rows, and a dead engine's share again.

``generate_rows`` gives each engine a fixed share of the groups as one call, so
what an engine decodes together is decided by the request, never by timing; a
dead engine's share is regenerated whole after its restart. ``group_rows`` turns
``generate_groups``'s prompts and seeds into such rows. ``EngineGroup``
(``engines.group``) answers both calls with these functions: it hands them
itself as the ``Engines`` (handles and names, all public) and the restart to
use. Never starts, places or restarts an engine itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from actors import deadline
from engines.types import EngineDeadError, GenerateResult

RestartFn = Callable[[int], None]


class Engines(Protocol):
    """What dispatch reads of a run's engines (``EngineGroup`` is one)."""

    run_name: str

    def handles(self) -> dict[int, ActorHandle]: ...

    def handle(self, i: int) -> ActorHandle | None: ...

    def actor_name(self, i: int) -> str: ...


def group_rows(
    prompts: list[list[int]], n: int, sampling: dict[str, Any], seeds: list[list[int]]
) -> tuple[list[list[list[int]]], list[list[dict[str, Any]]]]:
    """``n`` rows per prompt and their parameters; ``seeds[g][j]``: sample j of prompt
    g's sampling_seed."""
    if len(seeds) != len(prompts) or any(len(s) != n for s in seeds):
        raise ValueError("seeds must hold n seeds for each prompt")
    rows = [[p] * n for p in prompts]
    params = [[dict(sampling, sampling_seed=int(s)) for s in row] for row in seeds]
    return rows, params


def generate_rows(
    engines: Engines,
    rows: list[list[list[int]]],
    params: list[list[dict[str, Any]]],
    restart: RestartFn,
    max_restarts: int,
    call_timeout_s: float | None,
    lora_path: str | None = None,
) -> list[list[GenerateResult]]:
    """Generate each of group g's rows ``rows[g]`` with its ``params[g]`` entry
    (a partial rollout's continuation: a sample's prompt and its tokens so far).
    Group g goes to engine ``g % engines`` (index order) in that engine's one
    call, never decoded with another call's rows: the result is a function of
    the request and the weights, not of timing. A dead engine is restarted
    (``restart(i)``) at most ``max_restarts`` times and its share sent again
    whole, so no group mixes versions; CallTimeout after ``call_timeout_s``.
    ``lora_path``: the adapter every row samples from (None: the base weights)."""
    if len(params) != len(rows) or any(len(p) != len(r) for p, r in zip(params, rows)):
        raise ValueError("params must hold one dict for each row")
    handles = engines.handles()
    if not handles:
        raise RuntimeError(f"no engines of run {engines.run_name!r} exist: call start() first")
    order = sorted(handles)
    shares = {i: list(range(pos, len(rows), len(order))) for pos, i in enumerate(order)}
    restarts = {i: 0 for i in order}
    results: list[list[GenerateResult]] = [[] for _ in rows]
    clock = deadline.Deadline(call_timeout_s)

    def send(i: int) -> ray.ObjectRef:
        share = shares[i]
        flat = [row for g in share for row in rows[g]]
        share_params = [p for g in share for p in params[g]]
        if lora_path is None:
            return handles[i].generate.remote(flat, share_params)
        return handles[i].generate.remote(flat, share_params, lora_path=lora_path)

    inflight = {send(i): i for i in order if any(rows[g] for g in shares[i])}
    while inflight:
        done, _ = ray.wait(list(inflight), num_returns=1, timeout=clock.remaining())
        if not done:  # the deadline passed with every call still waiting
            waiting = [engines.actor_name(e) for e in inflight.values()]
            raise clock.expired(waiting, f"generate ({len(inflight)} engine shares waiting)")
        i = inflight.pop(done[0])
        try:
            out = ray.get(done[0])
        except (RayActorError, EngineDeadError):  # the actor, or its decode loop, died
            restarts[i] += 1
            if restarts[i] > max_restarts:
                raise
            restart(i)
            handles[i] = _restarted(engines, i)
            inflight[send(i)] = i  # the whole share again, on the restarted engine
            continue
        start = 0  # the share's rows, back into their groups
        for g in shares[i]:
            results[g] = out[start : start + len(rows[g])]
            start += len(rows[g])
    return results


def _restarted(engines: Engines, i: int) -> ActorHandle:
    h = engines.handle(i)
    if h is None:
        raise RuntimeError(f"{engines.actor_name(i)} is missing after its restart")
    return h

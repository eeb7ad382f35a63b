"""Colocated placement: which side holds the shared devices during each step.

With ``placement.colocate`` train ranks and engine ranks share devices (one
bundle each of ``{run}/colocate-pg``, see ``actors.placement``) and take
turns on them. A step that works on a device first puts the actors in the
state it needs; it never relies on the state an earlier step left, so a
retried or rerun step, a restarted engine and a re-created train rank (both
start awake) all end in the same state:

    step                          train ranks   engines
    rollout                       asleep        awake
    train, save, publish          awake         asleep
    reload (disk)                 asleep        awake (the one reloaded)
    reload (tensor/distributed)   awake         awake (the one updated)
    verify                        as left       awake (the one verified)

Whatever goes to sleep goes first, so a device never holds both sides'
weights except during an in-memory update, which needs both. Each function
returns the states it left, ``{"train": [per rank], "engines": {"<id>": ...}}``
(states: awake, asleep; engines also dead or absent), which the steps record in
their ledger results. Without colocation they do nothing and return None.
Sleep and wake are idempotent, so calling one twice is cheap and harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import ray

log = logging.getLogger("prefect_rl.colocate")

Memory = dict[str, Any]


def colocated(ctx) -> bool:
    return ctx.cfg.placement.colocate


def for_rollout(ctx) -> Memory | None:
    """Train ranks asleep, then every engine awake."""
    if not colocated(ctx):
        return None
    train = _train(ctx, "offload")
    return {"train": train, "engines": _engines(ctx, _all(ctx), wake=True)}


def for_training(ctx) -> Memory | None:
    """Every engine asleep, then the train ranks awake (train, save, publish)."""
    if not colocated(ctx):
        return None
    engines = _engines(ctx, _all(ctx), wake=False)
    return {"train": _train(ctx, "onload"), "engines": engines}


def for_update(ctx, engine_id: int, push: bool) -> Memory | None:
    """Engine ``engine_id`` awake for a weight update, the train ranks awake when they
    push their state to it (in-memory transports), else asleep first (disk)."""
    if not colocated(ctx):
        return None
    train = _train(ctx, "onload" if push else "offload")
    return {"train": train, "engines": _engines(ctx, [engine_id], wake=True)}


def wake_engine(ctx, engine_id: int) -> Memory | None:
    """Engine ``engine_id`` awake, the trainer left as it is: its health check runs a
    forward. For verify, which must not put ranks to sleep while another engine's
    mapped update may be pushing from them."""
    if not colocated(ctx):
        return None
    return {"engines": _engines(ctx, [engine_id], wake=True)}


# The turns a step can declare (``tasks.runner.Step.turn``); the runner takes
# the turn before the step's ``ready`` phase and again after it, since actors
# that phase re-created start awake. Reload declares none: its transport
# decides (``for_update``, push or not) inside ``tasks.serving.transports``.
TURNS = {
    "rollout": lambda ctx, engine_id: for_rollout(ctx),
    "training": lambda ctx, engine_id: for_training(ctx),
    "engine": lambda ctx, engine_id: wake_engine(ctx, engine_id),
}


def take_turn(ctx, turn: str, engine_id: int | None) -> Memory | None:
    """Apply the declared turn ``turn`` (a key of TURNS); the states it left."""
    if turn not in TURNS:
        raise ValueError(f"unknown colocation turn {turn!r}; declare one of {sorted(TURNS)}")
    return TURNS[turn](ctx, engine_id)


def recorded(memory: Memory | None) -> dict[str, Any]:
    """The ``memory`` entry of a step result ({} without colocation)."""
    return {} if memory is None else {"memory": memory}


def _all(ctx) -> range:
    return range(ctx.cfg.engines.num_engines)


def _train(ctx, method: str) -> list[str]:
    reports = getattr(ctx.trainer(), method)()  # [] when no rank is alive
    if any(r.get("changed") for r in reports):
        log.info("colocate %s: train ranks %s (%s)", ctx.run_name, method, reports[0].get("mode"))
    return [r["state"] for r in reports]


def _engines(ctx, ids: Iterable[int], wake: bool) -> dict[str, str]:
    """Wake or put to sleep engines ``ids`` (in parallel); their states by id."""
    group = ctx.engines()
    method = "resume_memory_occupation" if wake else "release_memory_occupation"
    states: dict[str, str] = {}
    refs = {}
    for i in ids:
        h = group.handle(i)
        if h is None:
            states[str(i)] = "absent"  # the step's own ensure_* starts it (awake)
        else:
            refs[i] = getattr(h, method).remote()
    for i, ref in refs.items():
        try:
            reply = ray.get(ref, timeout=ctx.cfg.engines.health_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            log.warning("engine %d: %s failed (%s); treated as dead", i, method, type(e).__name__)
            states[str(i)] = "dead"  # restarted by the step that needs it, awake
            continue
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"engine {i} refused {method}: {reply.get('message')}")
        # SGLang's reply has no state; a successful call means it holds.
        state = reply.get("state") if isinstance(reply, dict) else None
        states[str(i)] = state or ("awake" if wake else "asleep")
        if isinstance(reply, dict) and reply.get("changed"):
            log.info("colocate %s: engine %d %s", ctx.run_name, i, states[str(i)])
    return dict(sorted(states.items(), key=lambda kv: int(kv[0])))

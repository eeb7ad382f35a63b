"""What the rollout procedure reaches through the cluster (``rollout.procedure.RolloutIO``):

- ``EngineTurns``: multi-turn episodes' model turns as SGLang ``/generate``
  calls to the engines' HTTP API (``engines.client``, the same protocol for the
  embedded engine and an SGLang server), their errors sorted into the failure
  kinds of ``rollout.failures``, and the engine a failed call goes to next;
- ``ray_scorer``: a batch's reward scoring fanned out as Ray tasks
  (``rollout.reward_workers``), spread over the cluster's nodes, each task
  scoring its share with ``rollout.rewards.score`` (a slow verifier, or posts
  to a reward server), all waited for by the step's deadline
  (``actors.deadline``);
- the failure log of rollout k, persisted in the ledger as ``rollout-failures``
  each time it changes, and read back by a retried rollout step.

Plain Ray, not prefect-ray: the steps run without Prefect (the plain driver
walks the same plan), and a Prefect task run per share would cost its API
round trips. No Prefect here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import ray
from ray.exceptions import RayActorError

from actors import deadline
from engines.client import EngineClient, EngineHTTPError
from rollout import rewards
from rollout.config import RolloutConfig
from rollout.failures import EngineUnavailable, FailureLog, RequestRefused
from rollout.procedure import RolloutIO
from rollout.rewards import Scorer
from tasks.serving.engine import engine_client

log = logging.getLogger("prefect_rl.rollout")

FAILURES_RECORD = "rollout-failures"  # ledger/iter_k/rollout-failures.json


class EngineTurns:
    """``rollout.agent.TurnEngines`` over a run's engines, each reached by ``client(i)``.

    A failed call moves to the next engine in index order that has not failed
    in this rollout; when every engine has, the failed one is restarted on the
    rollout's version (``restart``) unless another share already brought it
    back (``is_alive``)."""

    def __init__(
        self,
        client: Callable[[int], EngineClient],
        engine_ids: list[int],
        is_alive: Callable[[int], bool],
        restart: Callable[[int], None],
    ) -> None:
        self._connect, self._ids = client, list(engine_ids)
        self._is_alive, self._restart = is_alive, restart
        self._clients: dict[int, EngineClient] = {}
        self._failed: set[int] = set()
        self._lock = threading.Lock()

    def engine_ids(self) -> list[int]:
        return list(self._ids)

    def generate(
        self, engine: int, input_ids: list[list[int]], sampling: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        try:
            out = self._client(engine).generate(
                input_ids=input_ids, sampling_params=sampling, return_logprob=True
            )
        except EngineHTTPError as e:
            if 400 <= e.status < 500 and e.status not in (408, 429):
                raise RequestRefused(f"engine {engine}: {e}") from e
            self._forget(engine)
            raise EngineUnavailable(f"engine {engine}: {e}") from e
        except (TimeoutError, httpx.HTTPError, RayActorError, RuntimeError) as e:
            # RuntimeError: the engine's actor is gone, so it serves no HTTP
            self._forget(engine)
            raise EngineUnavailable(f"engine {engine}: {e}") from e
        return out if isinstance(out, list) else [out]

    def failover(self, engine: int) -> int:
        with self._lock:
            self._failed.add(engine)
            ids = self.engine_ids()
            start = ids.index(engine)
            for nxt in ids[start + 1 :] + ids[:start]:
                if nxt not in self._failed:
                    log.warning(
                        "engine %d failed a rollout call; sending it to engine %d", engine, nxt
                    )
                    return nxt
            if not self._is_alive(engine):
                log.warning(
                    "engine %d failed a rollout call and no other is left; restarting it", engine
                )
                self._restart(engine)
            self._failed.discard(engine)
            return engine

    def _client(self, engine: int) -> EngineClient:
        with self._lock:
            if engine not in self._clients:
                self._clients[engine] = self._connect(engine)
            return self._clients[engine]

    def _forget(self, engine: int) -> None:
        with self._lock:
            client = self._clients.pop(engine, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for engine in list(self._clients):
            self._forget(engine)


def ray_scorer(cfg: RolloutConfig, timeout_s: float | None) -> Scorer | None:
    """Scoring over ``rollout.reward_workers`` Ray tasks; None (in process) when 0."""
    workers = cfg.reward_workers
    if not workers:
        return None
    # No CPU reserved: a share mostly waits (a reward server, a sandbox); SPREAD
    # puts the shares on the cluster's nodes, so a slow verifier scales with it.
    task = ray.remote(num_cpus=0, scheduling_strategy="SPREAD", max_retries=1)(rewards.score)

    def score(items: list[dict[str, Any]]) -> list[float]:
        size = -(-len(items) // workers)  # contiguous shares, in order
        shares = [items[i : i + size] for i in range(0, len(items), size)]
        refs = [task.remote(cfg, share) for share in shares]
        names = [f"reward task {i} of {len(refs)}" for i in range(len(refs))]
        parts = deadline.get(refs, timeout_s, "score rewards", names)
        return [r for part in parts for r in part]

    return score


@contextmanager
def rollout_io(
    ctx: Any, group: Any, k: int, restart: Callable[[int], None], persist: bool = True
) -> Iterator[RolloutIO]:
    """The engines' HTTP API, reward scoring and the failure log of rollout k.
    ``persist=False`` (evaluation): the failure log is kept in memory only, so it
    never touches rollout k's ledger record."""
    cfg = ctx.cfg.rollout
    score = ray_scorer(cfg, ctx.cfg.tasks.timeout_s)
    if cfg.environment == "none":
        yield RolloutIO(score=score)
        return
    store = ctx.store
    failures = (
        FailureLog(
            cfg.failures,
            k,
            cfg.batch_size,
            persisted=store.read_record(k, FAILURES_RECORD),
            persist=lambda record: store.write_record(k, FAILURES_RECORD, record, overwrite=True),
        )
        if persist
        else None  # generate_batch keeps one in memory
    )
    ids = list(range(ctx.cfg.engines.num_engines))
    turns = EngineTurns(lambda i: engine_client(ctx, group, i), ids, group.is_alive, restart)
    try:
        yield RolloutIO(turns=turns, score=score, failures=failures)
    finally:
        turns.close()

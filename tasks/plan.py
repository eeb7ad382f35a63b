"""The plan of one iteration: which step runs for which k, and what it waits for.

The DAG is written here once; ``flows.iteration`` (Prefect task runs) and
``flows.driver`` (plain threads) both hand ``iteration_plan(ctx, k)`` to
``walk``, which starts each node as soon as the nodes it waits for finished.

With ``rollout.max_staleness: 0`` (the default, strictly on-policy) the plan is
a chain. With ``max_staleness: 1`` iteration k also generates the next batch,
rollout[k+1], on the weights engines serve during train[k] (v(k-1)), so
generation overlaps training; reload[k] waits for it, because engines switch
versions only between batches. Which version generates which batch is a
function of the config (``steps.rollout_source``), never of timing:

    max_staleness 0                      max_staleness 1

    rollout[k]                           rollout[k] (made in iteration k-1)
        │                                  ├────────────────┐
    train[k] → save[k] → publish[k]      train[k]        rollout[k+1] on v(k-1)
        │                                save[k]            │
    reload[k, e] → verify[k, e]          publish[k]         │
        │                                  └───────┬────────┘
    finish[k]                            reload[k, e] → verify[k, e] → finish[k]

Nothing here imports Prefect or Ray.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.evaluation import due
from tasks import steps
from tasks.runner import Step


@dataclass(frozen=True)
class Node:
    """One task run of the plan: ``step`` for iteration ``k`` (and one engine)."""

    step: Step
    k: int  # the iteration the step works for (k + 1 for a rollout made ahead)
    engine_id: int | None = None  # per-engine steps: one node per engine
    after: tuple[str, ...] = field(default=())  # ids of the nodes it waits for

    @property
    def id(self) -> str:
        """Unique within a plan: the ledger key and the iteration, e.g. ``reload-e1@3``."""
        return f"{self.step.key(self.engine_id)}@{self.k}"


def iteration_plan(ctx, k: int) -> tuple[Node, ...]:
    """The nodes of iteration k, in a valid start order (see the module docstring)."""
    rollout = Node(steps.ROLLOUT, k)
    train = Node(steps.TRAIN, k, after=(rollout.id,))
    save = Node(steps.SAVE, k, after=(train.id,))
    publish = Node(steps.PUBLISH, k, after=(save.id,))
    nodes = [rollout, train, save, publish]
    # Batches made ahead, each after the one before: engines generate one batch at a time.
    last = rollout
    for j in range(k + 1, min(k + ctx.cfg.rollout.max_staleness, ctx.cfg.run.iterations) + 1):
        last = Node(steps.ROLLOUT, j, after=(last.id,))
        nodes.append(last)
    ahead = () if last is rollout else (last.id,)
    verifies = []
    for e in steps.RELOAD.engine_ids(ctx):
        reload = Node(steps.RELOAD, k, e, after=(publish.id, *ahead))
        verify = Node(steps.VERIFY, k, e, after=(reload.id,))
        nodes += [reload, verify]
        verifies.append(verify.id)
    last = tuple(verifies)
    if due(ctx.cfg.eval, k, ctx.cfg.run.iterations):  # eval.interval: what engines serve now
        nodes.append(evaluate := Node(steps.EVALUATE, k, after=last))
        last = (evaluate.id,)
    nodes.append(Node(steps.FINISH, k, after=last))
    return tuple(nodes)


def node_inputs(node: Node, done: dict[str, Any]) -> dict[str, Any]:
    """Extra inputs of a node: the finish step gets its iteration's results by ledger key."""
    if node.step is not steps.FINISH:
        return {}
    suffix = f"@{node.k}"
    return {"results": {i.removesuffix(suffix): r for i, r in done.items() if i.endswith(suffix)}}


class Future(Protocol):
    """What ``walk`` needs of a started node (concurrent.futures and Prefect futures alike)."""

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...

    def result(self) -> Any: ...


def walk(nodes: Sequence[Node], start: Callable[[Node, dict[str, Any]], Future]) -> dict[str, Any]:
    """Start every node once all it waits for succeeded; return results by node id.

    ``start(node, done)`` begins one node (``done``: results so far) and returns
    its future. After the first failure nothing new starts; nodes already running
    are waited for (so none outlives the walk), then the first error is raised.
    """
    pending = list(nodes)
    known = {n.id for n in nodes}
    for n in nodes:
        missing = [a for a in n.after if a not in known]
        if missing:
            raise ValueError(f"plan node {n.id} waits for {missing}, which are not in the plan")
    finished: queue.Queue[str] = queue.Queue()
    running: dict[str, Future] = {}
    done: dict[str, Any] = {}
    error: BaseException | None = None
    while pending or running:
        if error is None:
            for n in [n for n in pending if all(a in done for a in n.after)]:
                pending.remove(n)
                running[n.id] = fut = start(n, done)
                fut.add_done_callback(lambda _f, i=n.id: finished.put(i))
        if not running:
            if error is None:  # nothing runs and nothing can start: the plan has a cycle
                raise ValueError(f"plan nodes {[n.id for n in pending]} wait for each other")
            break  # what is left waits for a node that failed
        i = finished.get()
        try:
            done[i] = running.pop(i).result()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after in-flight nodes end
            error = error or e
    if error is not None:
        raise error
    return done

"""The plan of one iteration: which step runs for which k, and what it waits for.

The DAG is written here once; ``flows.iteration`` (Prefect task runs) and
``flows.driver`` (plain threads) both hand ``iteration_plan(ctx, k)`` to
``walk``, which starts each node as soon as the nodes it waits for finished.

With ``rollout.max_staleness: 0`` (the default, strictly on-policy) the plan is
a chain. With ``max_staleness: N`` iteration k also generates batch k+N, on the
weights engines serve during train[k] (v(k-1)), so generation overlaps
training; reload[k] waits for it, because engines switch versions only between
batches. Batches k+1..k+N-1 were made by the iterations before (iteration j-N
makes batch j), so they are not in the plan: at most N batches wait on storage
for the trainer. Which version generates which batch is a function of the
config (``tasks.rollouts.versions``), never of timing:

    max_staleness 0                      max_staleness N (1..16)

    rollout[k]                           rollout[k] (made in iteration k-N)
        │                                  ├────────────────┐
    train[k] → save[k] → publish[k]      train[k]        rollout[k+N] on v(k-1)
        │                                save[k]            │
    reload[k, e] → verify[k, e]          publish[k]         │
        │                                  └───────┬────────┘
    finish[k]                            reload[k, e] → verify[k, e] → finish[k]

The first iteration makes batches 1..1+N (all on v0). With ``eval.interval`` and
``eval.before_training`` it first evaluates the base model (``evaluate[0]``);
its rollout[1] waits for that, and finish[1] writes its scores as eval_base_*. With ``rollout.partial``
batch j > N is two nodes (``tasks.rollouts.partial``) in two iterations: its head
(the first ``rollout.partial_chunk`` tokens of every sample) on v(j-1-N) beside
train[j-N], and its rest on v(j-N) in iteration j-N+1, first on the engines,
which serve v(j-N) from reload[j-N] until reload[j-N+1]. So iteration k, on
v(k-1), continues batch k+N-1 and then starts batch k+N, both beside train[k]
(N >= 2; with N = 1, batch k+N-1 is batch k, which train[k] waits for):

    rollout_head[k+N-1] (made in k-1) → rollout[k+N-1] (the rest) → rollout_head[k+N]
    rollout[k] → train[k] → save[k] → publish[k]                          │
                                          └──────────────┬────────────────┘
                                 reload[k, e] → verify[k, e] → finish[k]

Nothing here imports Prefect or Ray.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.evaluation import due
from tasks import steps
from tasks.metrics_row import BASE_EVAL
from tasks.rollouts.versions import continue_source
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
    n, last_k = ctx.cfg.rollout.max_staleness, ctx.cfg.run.iterations
    nodes: list[Node] = []
    chain: tuple[str, ...] = ()  # the batch before: engines generate one batch at a time
    if k == 1 and due(ctx.cfg.eval, 0, last_k):  # the base model, before any batch
        nodes.append(base := Node(steps.EVALUATE, 0))
        chain = (base.id,)
    for j in range(k, min(k + n, last_k) + 1):
        # Batches between k and k+N were made by earlier iterations' plans (iteration j-N's,
        # or with partial rollouts j-N+1's); one that is missing is made here, in order:
        # with partial rollouts batch k+N-1, whose head iteration k-1 made, and a batch
        # run.iterations added.
        if k < j < k + n and _made(ctx, j):
            continue
        if continue_source(ctx, j) is not None and (j == k + n or not _made(ctx, j)):
            head = Node(steps.ROLLOUT_HEAD, j, after=chain)
            nodes.append(head)
            chain = (head.id,)
            if j == k + n:  # its rest on v(k), beside train[k+1]: iteration k+1 plans it
                continue
        nodes.append(batch := Node(steps.ROLLOUT, j, after=chain))
        chain = (batch.id,)
    train = Node(steps.TRAIN, k, after=(f"{steps.ROLLOUT.key()}@{k}",))
    save = Node(steps.SAVE, k, after=(train.id,))
    publish = Node(steps.PUBLISH, k, after=(save.id,))
    nodes += [train, save, publish]
    ahead = () if chain == (f"{steps.ROLLOUT.key()}@{k}",) else chain
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


def _made(ctx, j: int) -> bool:
    """Batch j is persisted and committed (its rollout record is in the ledger)."""
    return ctx.store.read_record(j, steps.ROLLOUT.key()) is not None


def node_inputs(node: Node, done: dict[str, Any]) -> dict[str, Any]:
    """Extra inputs of a node: the finish step gets its iteration's results by ledger key
    (iteration 1's also the base model's evaluation, as ``evaluate_base``)."""
    if node.step is not steps.FINISH:
        return {}
    suffix = f"@{node.k}"
    results = {i.removesuffix(suffix): r for i, r in done.items() if i.endswith(suffix)}
    base = f"{steps.EVALUATE.key()}@0"
    if node.k == 1 and base in done:
        results[BASE_EVAL] = done[base]
    return {"results": results}


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

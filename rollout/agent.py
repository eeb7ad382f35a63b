"""Multi-turn episodes: the model's turns on the engines, the environment's
observations in between, under each prompt's failure budget.

Each prompt's n episodes run in an environment (``rollout.environments``). An
episode's context is its prompt followed by every turn so far; a model turn is
one row of an SGLang ``/generate`` call (``TurnEngines``, the engines' HTTP API
as the step reaches it), seeded by ``(seed, k, prompt, j, turn)``.

Dispatch is fixed, never timed: prompt g goes to the engine at position
``g % engines``; each engine's share runs in its own thread, one call per turn
holding the share's unfinished episodes in order. An engine decodes one call's
rows together and never with another call's, so every number is a function of
the call, and a call sent again to another engine (same rows, seeds, weights)
gives the same numbers: an infrastructure retry never changes the batch.

Failures follow ``rollout.failures`` (``rollout.failures.FailureLog``): a
failed call costs each of its prompts a strike and goes to the next engine
(``TurnEngines.failover``); a refused call is split into rows sent alone, and
a refused row costs its prompt a data strike. A prompt past its budget fails
with all its episodes; after the pass, failed prompts (and the ones an earlier
attempt of the step dropped) are replaced by spares, which run in another pass.
No Prefect, Ray or engines here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.config import RolloutConfig
from rollout.datasets import encode_observation
from rollout.environments import Environment, make_environment
from rollout.failures import (
    EngineUnavailable,
    FailureLog,
    RequestRefused,
    RolloutStalled,
    VersionMismatch,
)
from rollout.seeding import turn_seed
from rollout.types import Prompt, Sample, Turn


class TurnEngines(Protocol):
    """The engines as multi-turn rollouts reach them: SGLang ``/generate``.

    ``generate`` raises ``EngineUnavailable`` when the engine could not serve the
    call and ``RequestRefused`` when it refused the request as invalid."""

    def engine_ids(self) -> list[int]: ...

    def generate(
        self, engine: int, input_ids: list[list[int]], sampling: list[dict[str, Any]]
    ) -> list[dict[str, Any]]: ...

    def failover(self, engine: int) -> int:
        """The engine to send a call to after it failed on ``engine``."""
        ...


@dataclass
class _Episode:
    prompt: Prompt
    j: int  # sample index
    prompt_ids: list[int]
    env: Environment
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0  # the environment's step rewards
    done: bool = False

    def context(self) -> list[int]:
        return self.prompt_ids + [t for turn in self.turns for t in turn.ids]


@dataclass(frozen=True)
class Episodes:
    """A multi-turn rollout: what ``run_episodes`` produced, in batch order."""

    prompts: list[Prompt]  # the batch's prompts, spares in the place of failed ones
    samples: list[Sample]  # n per kept prompt, contiguous; reward: the environment's only
    answers: list[str]  # per sample: what rollout.reward scores


@dataclass
class _Run:
    """What every share of one pass shares."""

    cfg: RolloutConfig
    seed: int
    k: int
    version: int
    tokenizer: Any
    engines: TurnEngines
    log: FailureLog
    sampling: dict[str, Any]
    last_progress: float = field(default_factory=time.monotonic)

    def encode(self, text: str, ended: bool) -> list[int]:
        """An observation's tokens after a model turn (``ended``: it stopped at eos)."""
        return encode_observation(self.tokenizer, text, self.cfg.chat_template, ended)

    def generate(self, engine: int, rows: list[_Episode], turn: int) -> list[dict[str, Any]]:
        params = [
            dict(
                self.sampling, sampling_seed=turn_seed(self.seed, self.k, e.prompt.index, e.j, turn)
            )
            for e in rows
        ]
        outs = self.engines.generate(engine, [e.context() for e in rows], params)
        if len(outs) != len(rows):
            raise EngineUnavailable(f"engine {engine} answered {len(outs)} of {len(rows)} rows")
        for out in outs:
            meta = out["meta_info"]
            if (
                meta["finish_reason"]["type"] == "abort"
            ):  # paused or timed out: not the data's fault
                raise EngineUnavailable(f"engine {engine} aborted a request")
            if int(meta["weight_version"]) != self.version:
                raise VersionMismatch(
                    f"rollout[k={self.k}]: a turn came from weights v{meta['weight_version']}, "
                    f"expected v{self.version}; the engines were not reloaded: rerun reload_engines"
                )
        return outs

    def advance(self, e: _Episode, out: dict[str, Any], turn: int) -> None:
        """Append the model's turn and the environment's answer to it."""
        meta = out["meta_info"]
        ids = list(out["output_ids"])
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.turns.append(
            Turn(
                role="model",
                ids=ids,
                text=text,
                logprobs=[float(x[0]) for x in meta["output_token_logprobs"]],
                weight_version=int(meta["weight_version"]),
                finish_reason=meta["finish_reason"]["type"],
            )
        )
        step = e.env.step(text)
        e.reward += step.reward
        e.done = step.done or turn + 1 >= self.cfg.max_turns
        if not e.done and step.observation:
            ended = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
            e.turns.append(
                Turn(role="tool", ids=self.encode(step.observation, ended), text=step.observation)
            )


class _Share:
    """One engine's share of a pass: its episodes, turn after turn."""

    def __init__(self, run: _Run, engine: int, episodes: list[_Episode]) -> None:
        self.run, self.engine, self.episodes = run, engine, episodes
        self.failed: dict[int, tuple[str, str]] = {}  # prompt index -> (kind, last error)

    def __call__(self) -> dict[int, tuple[str, str]]:
        for turn in range(self.run.cfg.max_turns):
            rows = [e for e in self.episodes if not e.done and e.prompt.index not in self.failed]
            if not rows:
                break
            self._call(rows, turn)
            self.run.last_progress = time.monotonic()
        return self.failed

    def _call(self, rows: list[_Episode], turn: int) -> None:
        log = self.run.log
        while rows := [e for e in rows if e.prompt.index not in self.failed]:
            prompts = sorted({e.prompt.index for e in rows})
            try:
                outs = self.run.generate(self.engine, rows, turn)
            except EngineUnavailable as err:
                for p in log.strike(prompts, "infra", turn, self.engine, str(err)):
                    self.failed[p] = ("infra", str(err))
                self.engine = self.run.engines.failover(self.engine)
                continue
            except RequestRefused as err:
                if len(rows) > 1:  # which row? each alone (refusals are a function of the row)
                    for e in rows:
                        self._call([e], turn)
                    return
                for p in log.strike(prompts, "data", turn, self.engine, str(err)):
                    self.failed[p] = ("data", str(err))
                continue
            for e, out in zip(rows, outs):
                self.run.advance(e, out, turn)
            return


def run_episodes(
    cfg: RolloutConfig,
    seed: int,
    k: int,
    version: int,
    tokenizer: Any,
    engines: TurnEngines,
    prompts: list[Prompt],
    log: FailureLog,
    sampling: dict[str, Any],
    spares: Callable[[int], Prompt],
    encode_prompt: Callable[[str], list[int]],
) -> Episodes:
    """Every prompt's n episodes; failed prompts replaced by ``spares(index)`` or dropped."""
    run = _Run(cfg, seed, k, version, tokenizer, engines, log, sampling)
    slots: list[Prompt] = list(prompts)
    kept: dict[int, list[_Episode] | None] = {}  # batch position -> episodes (None: dropped)
    todo = list(range(len(slots)))
    while todo:
        batch = [slots[i] for i in todo]
        episodes, failed = _pass(run, batch, encode_prompt)
        later = []
        for pos, p in zip(todo, batch):
            why = failed.get(p.index)
            if why is None and log.replayed(p.index):
                why = ("replayed", "dropped by an earlier attempt of this step")
            if why is None:
                kept[pos] = episodes[p.index]
                continue
            spare = log.drop(p.index, *why)
            kept[pos] = None
            if spare is not None:
                slots[pos] = spares(spare)
                later.append(pos)
        todo = later
    out = Episodes(prompts=[], samples=[], answers=[])
    for pos in range(len(slots)):
        if kept[pos] is None:
            continue
        out.prompts.append(slots[pos])
        for e in kept[pos]:
            out.samples.append(_sample(e))
            out.answers.append(e.env.answer)
    return out


def _pass(
    run: _Run, prompts: list[Prompt], encode_prompt: Callable[[str], list[int]]
) -> tuple[dict[int, list[_Episode]], dict[int, tuple[str, str]]]:
    """One pass over ``prompts``: their episodes, and the prompts that failed."""
    n = run.cfg.n_samples_per_prompt
    episodes: dict[int, list[_Episode]] = {}
    for p in prompts:
        ids = encode_prompt(p.text)
        episodes[p.index] = []
        for j in range(n):
            env = make_environment(run.cfg.environment)
            env.reset(p)
            episodes[p.index].append(_Episode(p, j, list(ids), env))
    order = run.engines.engine_ids()
    if not order:
        raise RuntimeError(f"rollout[k={run.k}]: no engines to generate on")
    shares = [
        _Share(
            run,
            e,
            [x for g in range(pos, len(prompts), len(order)) for x in episodes[prompts[g].index]],
        )
        for pos, e in enumerate(order)
    ]
    failed: dict[int, tuple[str, str]] = {}
    pool = ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="rollout-share")
    try:
        pending: set[Future] = {pool.submit(s) for s in shares if s.episodes}
        run.last_progress = time.monotonic()
        while pending:
            left = run.last_progress + run.cfg.failures.stall_s - time.monotonic()
            if left <= 0:
                raise RolloutStalled(
                    f"rollout[k={run.k}]: no turn finished for rollout.failures.stall_s="
                    f"{run.cfg.failures.stall_s:g}s; an engine may hang: check its "
                    "/health_generate (the step's retry starts the rollout again)"
                )
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            for f in done:
                failed.update(f.result())
    finally:
        # A stalled share's thread is left to its call's own deadline (the engine client's).
        pool.shutdown(wait=not pending, cancel_futures=True)
    return episodes, failed


def _sample(e: _Episode) -> Sample:
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for t in e.turns:
        model = t.role == "model"
        ids += t.ids
        mask += [int(model)] * len(t.ids)
        logprobs += t.logprobs if model else [0.0] * len(t.ids)
    last = next(t for t in reversed(e.turns) if t.role == "model")
    return Sample(
        prompt_index=e.prompt.index,
        sample_index=e.j,
        prompt_ids=e.prompt_ids,
        response_ids=ids,
        response_logprobs=logprobs,
        reward=e.reward,
        weight_version=int(last.weight_version or 0),
        finish_reason=last.finish_reason,
        response_text=transcript(e.turns),
        loss_mask=mask,
        turns=list(e.turns),
    )


def transcript(turns: list[Turn]) -> str:
    """The turns as one line for logs and the UI: ``?3+4 → :7. → 7``."""
    return " → ".join(t.text for t in turns)


def tool_use(samples: list[Sample], environment: str) -> dict[str, float | int | None]:
    """How a multi-turn batch used its tools (the rollout step's ``tools`` result).

    ``calls`` / ``bad_calls``: well-formed and malformed calls (an observation in
    the environment's ``errors``); ``call_rate``: the fraction of samples with a
    well-formed call; ``correct``: samples with the full score (reward >= 1);
    ``correct_after_call``: of those, how many made a well-formed call. A
    measurement only: no reward depends on it."""
    errors = make_environment(environment).errors
    calls = bad = with_call = correct = correct_after = 0
    for s in samples:
        observations = [t.text for t in s.turns if t.role == "tool"]
        n_bad = sum(o in errors for o in observations)
        good = len(observations) - n_bad
        calls, bad, with_call = calls + good, bad + n_bad, with_call + (good > 0)
        if s.reward >= 1.0:
            correct += 1
            correct_after += good > 0
    return {
        "calls": calls,
        "bad_calls": bad,
        "call_rate": with_call / len(samples) if samples else 0.0,
        "correct": correct,
        "correct_after_call": correct_after,
    }


def tool_row_fields(tools: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics row's tool columns from the rollout's ``tools`` result ({} when single-turn)."""
    if not tools:
        return {}
    correct = tools["correct"]
    return {
        "tool_call_rate": tools["call_rate"],
        # of the answers with the full score, the fraction that followed a well-formed call
        "tool_correct_after_call": tools["correct_after_call"] / correct if correct else None,
    }

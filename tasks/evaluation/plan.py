"""What an evaluation of published versions will do, decided before anything starts.

Owns the version selection (``select_versions``: a list ``1,3,5``, a range
``2..6``, ``newest 3``, or ``all``), the check that each selected version is
committed (a manifest that reads) and the ``EvalPlan``: the evaluated prompts
split into shards, the engines' own group, and the identity of every shard's
result (``shard_key``: run, version and its manifest, the evaluated prompts'
content digest, shard, and ``EvalSettings``: sampling, reward and the engines).
Reading only: it never writes into the run, takes no lease and starts nothing.
No Prefect.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout.evaluation import EvalConfig, eval_prompts
from rollout.sharded_eval import prompts_digest, split
from rollout.types import Prompt
from tasks.config import RunConfig
from tasks.context import RunContext

_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")
_NEWEST = re.compile(r"^\s*newest\s+(\d+)\s*$", re.IGNORECASE)
VERSIONS_HELP = "a list '1,3,5', a range '2..6', 'newest N' or 'all'"


class VersionsError(ValueError):
    """A version selection that is malformed or names a version that is not committed."""


def select_versions(spec: str, committed: list[int], run: str) -> list[int]:
    """The versions ``spec`` names, ascending; VersionsError naming each missing
    version and the committed ones (nothing has started when this raises)."""
    committed = sorted(committed)
    text = spec.strip()
    if text.lower() == "all":
        wanted = list(committed)
    elif m := _NEWEST.match(text):
        count = int(m.group(1))
        if count < 1:
            raise VersionsError(f"versions {spec!r}: 'newest N' needs N >= 1")
        wanted = committed[-count:]
    elif m := _RANGE.match(text):
        a, b = int(m.group(1)), int(m.group(2))
        if a > b:
            raise VersionsError(f"versions {spec!r}: the range's start is after its end")
        wanted = list(range(a, b + 1))
    else:
        try:
            wanted = sorted({int(part) for part in text.split(",") if part.strip()})
        except ValueError:
            raise VersionsError(f"versions {spec!r} is not {VERSIONS_HELP}") from None
    if not wanted:
        raise VersionsError(
            f"versions {spec!r} selects no version of run {run!r}; committed: {committed}"
        )
    missing = [v for v in wanted if v not in committed]
    if missing:
        names = ", ".join(f"v{v}" for v in missing)
        raise VersionsError(
            f"run {run!r} has no committed version {names} (versions {spec!r}); "
            f"committed versions: {committed}. Evaluate those, or publish the missing "
            "ones first (the publish-weights deployment)"
        )
    return wanted


@dataclass(frozen=True)
class EvalSettings:
    """What a shard's numbers depend on besides the weights and the prompts: its cache
    key holds the digest of all of it, so a rerun that changes any of these scores
    anew instead of reusing shards whose numbers could differ."""

    n_samples: int  # sampled answers per prompt (pass@k's k)
    temperature: float  # the sampled round's temperature
    top_p: float  # rollout.top_p of the run
    max_new_tokens: int  # rollout.max_new_tokens of the run
    pass_threshold: float  # a sample passes when its reward reaches this
    seed: int  # run.seed: sampling seeds are (seed, version, prompt, j)
    reward: str  # rollout.reward of the run
    chat_template: bool  # rollout.chat_template of the run
    # The engines: which rows decode together (count, batch, tensor parallel), the
    # engine's kernels and the precision change a row's logits, so its sampled tokens.
    engine_kind: str  # engines.kind: embedded or sglang
    num_engines: int  # a shard's prompt g goes to engine g % num_engines
    max_batch_size: int  # engines.max_batch_size: rows decoded together
    tp_size: int  # engines.tp_size
    torch_threads: int  # engines.torch_threads: a CPU matmul's reduction order
    model_dtype: str  # model.dtype of the run
    engine_args: tuple[str, ...]  # SGLang's extra_args (its backends), () for embedded

    def digest(self) -> str:
        blob = json.dumps(self.__dict__, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def eval_settings(cfg: RunConfig, n_samples: int, temperature: float) -> EvalSettings:
    """The settings of an evaluation of ``cfg``'s run (its engines already the
    evaluation's: ``num_engines`` and kind as it starts them)."""
    e, r = cfg.engines, cfg.rollout
    return EvalSettings(
        n_samples=n_samples,
        temperature=temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        pass_threshold=cfg.eval.pass_threshold,
        seed=cfg.run.seed,
        reward=r.reward,
        chat_template=r.chat_template,
        engine_kind=e.kind,
        num_engines=e.num_engines,
        max_batch_size=e.max_batch_size,
        tp_size=e.tp_size,
        torch_threads=e.torch_threads,
        model_dtype=cfg.model.dtype,
        engine_args=tuple(e.sglang.extra_args) if e.kind == "sglang" else (),
    )


@dataclass(frozen=True)
class EvalPlan:
    """Everything a (version, shard) task needs; small and picklable."""

    ctx: RunContext  # the run's config with the evaluation's engines and rollout settings
    label: str  # names the record: {dataset}-{size}-n{n}-t{temperature}
    dataset: str  # builtin task name or file path
    versions: list[int]  # ascending, every one committed
    manifests: dict[int, str]  # version -> sha256 of its manifest's file list
    shards: list[list[Prompt]]  # the evaluated prompts, split
    dataset_digest: str  # prompts_digest of all evaluated prompts
    settings: EvalSettings
    group_name: str = field(default_factory=lambda: f"eval-{uuid.uuid4().hex[:8]}")

    @property
    def run(self) -> str:
        return self.ctx.run_name

    def shard_key(self, version: int, shard: int) -> str:
        """The Prefect cache key of one shard's result: equal keys, equal numbers."""
        parts = [
            self.manifests[version][:16],
            self.dataset_digest[:16],
            self.settings.digest()[:16],
            f"{len(self.shards)}x{len(self.shards[shard])}",
        ]
        return f"{self.run}/evals/v{version}/shard-{shard}-{'-'.join(parts)}"

    def summary(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "label": self.label,
            "dataset": self.dataset,
            "dataset_sha256": self.dataset_digest,
            "versions": self.versions,
            "prompts": sum(len(s) for s in self.shards),
            "shards": len(self.shards),
            "engines": self.ctx.cfg.engines.num_engines,
            "settings": dict(self.settings.__dict__),
        }


def manifest_digest(ctx: RunContext, version: int) -> str:
    """sha256 over a committed version's files (name, bytes, sha256)."""
    m = ctx.store.read_manifest(version)
    rows = sorted((f.name, f.bytes, f.sha256) for f in m.files)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def evaluated_prompts(ctx: RunContext, dataset: str, size: int) -> list[Prompt]:
    """The first ``size`` prompts of ``dataset`` as evaluate[k] reads them: a builtin
    task's held-out indices, or a JSONL/Parquet/GSM8K-format file's first rows
    (its fields: the run's rollout.input_key and label_key)."""
    cfg = EvalConfig(dataset=dataset, size=size)
    return eval_prompts(cfg, ctx.cfg.rollout, ctx.cfg.run.seed)


def make_plan(
    ctx: RunContext,
    versions: list[int],
    dataset: str,
    size: int,
    shard_size: int,
    settings: EvalSettings,
) -> EvalPlan:
    """The plan over committed ``versions`` (checked by ``select_versions``)."""
    prompts = evaluated_prompts(ctx, dataset, size)
    label = f"{_slug(dataset)}-{len(prompts)}-n{settings.n_samples}-t{settings.temperature:g}"
    return EvalPlan(
        ctx=ctx,
        label=label,
        dataset=dataset,
        versions=versions,
        manifests={v: manifest_digest(ctx, v) for v in versions},
        shards=split(prompts, shard_size),
        dataset_digest=prompts_digest(prompts),
        settings=settings,
    )


def _slug(dataset: str) -> str:
    name = dataset.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name) or "dataset"

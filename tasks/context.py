"""RunContext: the small, picklable handle every step receives.

It carries settings only (the RunConfig and the local base-model path). Runtime
objects (the store, the engine and train groups) are rebuilt from it wherever a
step runs, in the flow process or in a Ray worker, so nothing heavy or live is
ever passed between tasks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

from storage.run_store import RunStore
from tasks.config import RunConfig


@dataclass(frozen=True)
class RunContext:
    cfg: RunConfig  # the validated run config
    base_model_path: str  # local HF dir of v0 (tiny model or model.path)
    owner: str = field(
        default_factory=lambda: f"{os.uname().nodename}:{os.getpid()}"
    )  # lease owner
    driver_pid: int = field(
        default_factory=os.getpid
    )  # the flow process (fault injection: sigkill)
    # The lease's fence (set by prepare_run / open_run once the lease is taken):
    # every commit through ``store`` checks it, so a writer whose lease another
    # took over fails its next commit (LeaseLostError) wherever the step runs.
    fence: int | None = None

    @property
    def run_name(self) -> str:
        return self.cfg.run.name

    @cached_property
    def store(self) -> RunStore:
        return RunStore(self.cfg.storage, self.cfg.run.name, fence=self.fence)

    def gc(self, keep_last: int) -> dict:
        """Retention over the run: versions and checkpoints beyond the last
        ``keep_last`` (never one an engine serves), and PPO's critic checkpoints
        alike. What was deleted and kept, as the gc-versions flow logs it."""
        report = self.store.gc(keep_last).model_dump()
        if self.cfg.train.loss.advantage == "gae":
            from training.critic_store import CriticStore

            critic = CriticStore(self.cfg.storage, self.run_name, fence=self.fence)
            report["critic"] = critic.gc(keep_last).model_dump()
        return report

    def placement(self):  # -> actors.placement.SharedPlacement | None
        """The shared placement group of a colocated run; None when disaggregated."""
        if not self.cfg.placement.colocate:
            return None
        from actors.placement import SharedPlacement, colocated_bundles

        e, t = self.cfg.engines, self.cfg.train
        bundles = colocated_bundles(
            train_ranks=t.num_workers,
            train_cpus=t.num_cpus_per_worker,
            engine_ranks=e.num_engines * e.tp_size,
            engine_cpus=e.num_cpus_per_engine,
            gpus=t.num_gpus_per_worker > 0,
            resource=e.node_resource,  # the same as train's: RunConfig refuses others
        )
        return SharedPlacement(self.run_name, tuple(bundles), e.tp_size, e.node_resource)

    def engines(self):  # -> engines.group.EngineGroup
        from engines.group import EngineGroup

        return EngineGroup(
            self.run_name,
            self.cfg.engines,
            namespace=self.cfg.ray.namespace,
            placement=self.placement(),
            # The step's deadline: every wait on an engine ends by it (actors.deadline).
            call_timeout_s=self.cfg.tasks.timeout_s,
            adapters=self.adapters(),
        )

    def adapters(self):  # -> engines.types.AdapterServing | None
        """With train.lora, what engines must serve: adapters of its rank and modules,
        as many at once as the staleness keeps in use, plus the one being loaded."""
        from engines.types import AdapterServing

        lora = self.cfg.train.lora
        if lora is None:
            return None
        return AdapterServing(
            max_rank=lora.rank,
            target_modules=tuple(sorted(lora.target_modules)),
            max_loaded=self.cfg.rollout.max_staleness + 2,
        )

    def trainer(self):  # -> TrainGroup, or ActorCriticGroup for PPO (training.actor_critic)
        from training.actor_critic import train_group
        from training.config import RunIdentity, TrainerSections

        c = self.cfg
        run = RunIdentity(name=c.run.name, seed=c.run.seed, namespace=c.ray.namespace)
        return train_group(
            run,
            TrainerSections.of(self.cfg),
            placement=self.placement(),
            fence=self.fence,
            call_timeout_s=self.cfg.tasks.timeout_s,
        )

    def tokenizer(self):  # -> transformers.PreTrainedTokenizerBase
        """The base model's tokenizer, loaded once per process (rollout and evaluation
        tokenize with it; a run's versions never change it)."""
        return _tokenizer(self.base_model_path)

    def __getstate__(self) -> dict:
        # cached_property values (the store's filesystem) are rebuilt after unpickling.
        return {k: v for k, v in self.__dict__.items() if k != "store"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


_TOKENIZERS: dict[str, object] = {}  # model path -> tokenizer, per process


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]

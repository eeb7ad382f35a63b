"""One train rank: model, optimizer and the trainer-state iteration it holds.

Owns what happens inside a rank: init from base weights, one GRPO step per
iteration over persisted rollouts, and the rank's collaborators, to which its
Ray-visible methods delegate: ``DurableState`` (``training.durable``: checkpoint
save/load and HF export through the run store), ``WeightPusher``
(``training.weight_pusher``: pushes to engines) and ``DeviceMemory``
(``actors.device_memory``: sleep and wake when colocated). Each is handed what
it needs at construction (the actor's backend hooks as a ``RankState``) or per
call, and none reads the actor. It is a plain class; ``training.group`` wraps it
in Ray. Never generates rollouts, never chooses which checkpoint to restore
and never imports Prefect.

Determinism (the recovery invariant): every step reseeds torch from
(seed, k, rank), runs micro-batches in a fixed order, and uses deterministic
algorithms where torch has them. Same config + same world size → same bytes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from actors.device_memory import DeviceMemory
from rollout.types import RolloutBatch
from training import backend_torch as bt
from training import checkpoint, lora
from training.algorithm import policy_loss
from training.batch import build_train_batch, rank_micro_batches
from training.config import RunIdentity, TrainerSections
from training.durable import DurableState, RankState
from training.export import drop_tied
from training.host_staging import HostStaging
from training.logprobs import pick_kernel
from training.mixed_precision import ComputeCopy
from training.types import MISMATCH_METRICS as MISMATCH
from training.types import RolloutMismatchError, mismatch_message
from training.warm_up import warm_up_batch
from training.weight_pusher import WeightPusher


class StateMismatchError(RuntimeError):
    """A step was asked of a trainer that holds a different iteration."""


def step_seed(seed: int, k: int, rank: int) -> int:
    return (seed * 1_000_003 + k * 1_009 + rank) % (2**63 - 1)


class TrainActor:
    def __init__(
        self,
        identity: RunIdentity,
        sections: TrainerSections,
        rank: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        self.identity, self.sections = identity, sections
        # The world size is train.num_workers: one source, so no rank can disagree with its group.
        self.rank, self.world_size = rank, sections.train.num_workers
        self.master_addr, self.master_port = master_addr, master_port
        self.cfg, self.model_cfg = sections.train, sections.model
        self.storage_cfg, self.weights_cfg = sections.storage, sections.weights
        self.run_name, self.seed = identity.name, identity.seed
        self.device = bt.pick_device(self.cfg.num_gpus_per_worker)
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        # The bf16 twin forwards and backwards run on (train.compute_dtype, one rank).
        self._compute: ComputeCopy | None = None
        self.optim: torch.optim.Optimizer | None = None
        self.base_model_path: str | None = None
        self.pad_id = 0
        self._iteration: int | None = None
        self._stores: dict[int | None, Any] = {}  # by fence
        # Checkpoints and published versions; the backend's parts are this actor's hooks.
        hooks = RankState(
            snapshot=self._checkpoint_snapshot,
            restore=self._restore,
            meta=self._checkpoint_meta,
            hf_state=self._hf_state,
        )
        place = (self.rank, self.world_size, self.seed, self.run_name)
        self.durable = DurableState(
            *place, self.weights_cfg, store=self.store, state=hooks, lora=self.cfg.lora
        )
        # Pushes of the held state to engines (weights.transport tensor / distributed).
        self.pusher = WeightPusher(self.rank, self.world_size, self.device)
        # Sleep and wake of this rank's tensors when colocated with engines.
        self.memory = DeviceMemory(self.device, "train")

    # -- lifecycle ---------------------------------------------------------
    def setup(self) -> None:
        """Threads, determinism and the process group; call once on every rank."""
        torch.set_num_threads(self.cfg.torch_threads)
        bt.set_determinism(self.device)
        bt.init_distributed(
            self.rank, self.world_size, self.master_addr, self.master_port, self.device
        )

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "iteration": self._iteration, "pid": os.getpid()}

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def iteration(self) -> int | None:
        """The trainer-state iteration held (0 = base weights); None before init."""
        return self._iteration

    def store(self, fence: int | None = None) -> Any:
        # Commits check ``fence`` (the caller's lease); it comes with each call, as actors outlive writers.
        if fence not in self._stores:
            from storage.run_store import RunStore

            self._stores[fence] = RunStore(self.storage_cfg, self.run_name, fence=fence)
        return self._stores[fence]

    def init_from_base(self, model_path: str) -> int:
        """Build model (+ frozen reference when kl_coef > 0) and AdamW from ``model_path``."""
        dtype, compute, n = self.model_cfg.dtype, self.sections.compute_dtype, self.world_size
        lora_on = self.cfg.lora is not None
        compiled = bt.should_compile_layers(self.cfg.compile_layers, self.device, n, lora_on)
        copy = n == 1 and compute != dtype  # fp32 master weights, bf16 forward and backward
        self.model = bt.build_model(
            model_path,
            dtype,
            self.device,
            n,
            compute,
            lora=self.cfg.lora,
            seed=self.seed,
            compiled=compiled and not copy,  # with a copy, the copy is what runs
        )
        if copy:
            self._compute = ComputeCopy(self.model, bt.DTYPES[compute])
            if compiled:
                bt.compile_layers(self._compute.model)
        if self.cfg.loss.kl_coef > 0 and self.cfg.lora is None:  # LoRA: the base, adapters off
            # Frozen: no master needed; it scores in the compute dtype, as the policy does.
            ref_dtype = compute if n == 1 else dtype
            self.ref_model = bt.build_model(
                model_path, ref_dtype, self.device, n, compute, compiled=compiled
            )
            self.ref_model.requires_grad_(False).eval()
        self.optim = bt.adamw(self.model, self.cfg.lr, self.cfg.weight_decay, self.device)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.base_model_path = model_path
        if compiled or pick_kernel(self.cfg.logprob_kernel, self.device) == "compiled":
            self._compile_now()
        self._iteration = 0
        return 0

    def _compile_now(self) -> None:
        """Run the step's passes once on ``training.warm_up``'s batch, so torch.compile
        builds their kernels now rather than in the first step. Nothing of it stays:
        the gradients are dropped, the optimizer never steps, the RNG is put back."""
        batch = warm_up_batch(self.model.config.vocab_size, self.sections.rollout.temperature)
        # Group advantages: the passes are the same for any advantage (gae's come
        # from a critic, which this batch has none of).
        loss = self.cfg.loss.model_copy(update={"advantage": "grpo"})
        full = build_train_batch(batch, self.pad_id, loss)
        mbs = rank_micro_batches(full, 0, 1, self.cfg)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            old, ref = self._reference_logprobs(mbs, batch.train_temperature)
            self._accumulate(mbs, old, ref, full.num_tokens, batch.train_temperature)
        self._zero_grad()

    # -- durable state and pushes (collaborators) ---------------------------
    def load_checkpoint(self, k: int) -> int:
        """Restore model, optimizer and RNG of checkpoint ``k`` (after init_from_base)."""
        self._require_model()
        self._iteration = self.durable.load(k)
        return self._iteration

    def save_checkpoint(
        self,
        k: int,
        meta_extra: dict | None = None,
        fence: int | None = None,
        background: bool = False,
        fail_background: bool = False,
    ) -> dict | None:
        """Collective. Rank 0 commits ``checkpoints/iter_k`` (fenced) and returns its
        meta; ``background`` writes it on a thread (``DurableState.save``)."""
        self._require_at(k, "save_checkpoint")
        return self.durable.save(k, meta_extra, fence, background, fail_background)

    def wait_saved(self) -> list[str]:
        """Wait for the background checkpoint write in flight; failures since last asked."""
        return self.durable.wait()

    def export_hf(
        self,
        version: int,
        iteration: int,
        parent: int | None,
        fence: int | None = None,
        background: bool = False,
    ) -> dict | None:
        """Collective. Rank 0 publishes ``weights/v{version}`` (fenced) and returns a
        summary; ``background`` writes it on a thread (``DurableState.publish``)."""
        self._require_model()
        return self.durable.publish(
            version, iteration, parent, self.model, self.base_model_path, fence, background
        )

    def push_weights(
        self,
        engine: Any,
        transport: str,
        bucket_bytes: int,
        flush_cache: bool,
        group_name: str = "",
    ) -> dict | None:
        """Collective. Rank 0 sends the trainer state it holds to ``engine`` as weight
        version ``iteration`` over ``transport`` ('tensor' or 'distributed')."""
        self._require_model()
        lora_cfg = self.cfg.lora  # an adapter push: peft's config goes with the tensors
        return self.pusher.push(
            engine,
            transport,
            self._iteration,
            self._push_tensors(),
            bucket_bytes,
            flush_cache,
            group_name,
            sleeps=self.memory.has_slept,
            model=self._bindable_model(),
            adapter=None if lora_cfg is None else lora.peft_config(lora_cfg, self.base_model_path),
        )

    # Backend hooks of the durable state (handed to it as a RankState) and of pushes:
    # the megatron actor overrides each.
    def _checkpoint_snapshot(self, copy: bool, staging: HostStaging) -> dict | None:
        """Collective: the checkpoint's contents on rank 0 (``checkpoint.snapshot``;
        an unsharded model's state lands in ``staging``'s reused host buffers)."""
        return checkpoint.snapshot(self.model, self.optim, self.rank, copy=copy, staging=staging)

    def _restore(self, store: Any, k: int) -> dict:
        """Load checkpoint ``k`` of ``store`` into the model and optimizer; its meta."""
        return checkpoint.load(store, k, self.model, self.optim)

    def _checkpoint_meta(self) -> dict:
        """What this backend adds to a checkpoint's meta."""
        return {}

    def _hf_state(self, staging: HostStaging | None = None) -> dict[str, torch.Tensor]:
        """What a version publishes (collective): the full state dict in HF names, tied
        output dropped, or with LoRA only the adapters, in peft's names. ``staging``:
        an unsharded model's state is copied into these reused host buffers (a
        background publish's host copy, at the link's speed)."""
        on_device = staging is not None and not bt.is_sharded(self.model)
        state = bt.full_model_state(self.model, on_device)
        if self.cfg.lora is not None:  # versions are adapters of v0
            state = lora.adapter_state(state)
        state = drop_tied(self.model, state)
        return staging.copy(state) if on_device else state

    def _push_tensors(self) -> Any:
        """(HF name, full tensor) pairs a push sends, one at a time; collective. With
        LoRA, only the adapters, in peft's names (every rank joins each gather)."""
        if self.cfg.lora is not None:
            full = dict(bt.iter_full_tensors(self.model))
            return iter(lora.adapter_state(full).items())
        return bt.iter_full_tensors(self.model)

    def _bindable_model(self) -> torch.nn.Module | None:
        """The model whose tensors a push's staging buffer may take over (one rank
        holds full tensors with the pushed names); None when sharded, or when a push
        sends LoRA adapters, which a push sends whole each time."""
        if bt.is_sharded(self.model) or self.cfg.lora is not None:
            return None
        return self.model

    def offload(self) -> dict[str, Any]:
        """Sleep: free the device memory of the weights, optimizer state and reference
        model for colocated engines (``actors.device_memory``: torch_memory_saver
        where installed, else moved to host memory; on CPU only the state changes).
        Idempotent; returns the memory report (``state``, ``mode``, bytes on device)."""
        return self.memory.sleep(
            [self.model, self.ref_model, self._compute and self._compute.model], self.optim
        )

    def onload(self) -> dict[str, Any]:
        """Wake: undo ``offload``, contents unchanged; a rank that never slept is awake."""
        return self.memory.wake(
            [self.model, self.ref_model, self._compute and self._compute.model], self.optim
        )

    def score(self, input_ids: list[list[int]], temperature: float = 1.0) -> torch.Tensor:
        """Next-token logprobs [B, T-1] of equal-length ``input_ids`` under the
        current weights at ``temperature`` (for evaluation and checks). Collective
        when sharded."""
        self._require_model()
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        policy = self._policy()
        policy.eval()
        with torch.no_grad():
            return bt.token_logprobs(policy, ids, torch.ones_like(ids), temperature)[0].cpu()

    # -- training ----------------------------------------------------------
    def train_step(self, k: int) -> dict[str, float]:
        """One optimizer step on rollouts ``k``; requires trainer state ``k - 1``."""
        self._require_at(k - 1, f"train_step({k})")
        t0 = time.perf_counter()
        batch = self._rollouts(k, f"train({k})")
        full = build_train_batch(batch, self.pad_id, self.cfg.loss, self._token_advantages(k))
        dp_rank = self._data_parallel_rank()
        mbs = rank_micro_batches(full, dp_rank, self._data_parallel_size(), self.cfg)
        torch.manual_seed(step_seed(self.seed, k, dp_rank))
        tau = batch.train_temperature
        old, ref = self._reference_logprobs(mbs, tau)
        sums = self._accumulate(mbs, old, ref, full.num_tokens, tau)
        over = self._mismatch_gate(k, batch, sums)
        grad_norm = self._clip_grad_norm()
        self.optim.step()
        self._zero_grad()
        self._iteration = k
        metrics = self._metrics(sums, grad_norm, full, time.perf_counter() - t0)
        return {**metrics, "temperature": tau, "rollout_logprob_kl_over": over}

    def _mismatch_gate(self, k: int, batch: RolloutBatch, sums: torch.Tensor) -> bool | None:
        """Whether ``rollout_logprob_kl`` is over ``train.mismatch.max_kl`` for a batch
        that the weights this rank holds made (only there is the gap not learning);
        None where the gate does not apply. ``on_exceed: error`` raises before the
        optimizer step, so the trainer still holds state k - 1."""
        gate = self.cfg.mismatch
        if gate.max_kl is None or any(s.versions != [k - 1] for s in batch.samples):
            return None
        n = max(float(sums[-1]), 1.0)
        kl = float(sums[5 + MISMATCH.index("rollout_logprob_kl")]) / n
        if kl <= gate.max_kl:
            return False
        if gate.on_exceed == "error":
            self._zero_grad()
            compiled_lora = self.cfg.lora is not None and self.cfg.compile_layers == "on"
            raise RolloutMismatchError(
                mismatch_message(k, kl, gate.max_kl, batch.train_temperature, compiled_lora)
            )
        return True

    def _rollouts(self, k: int, step: str) -> RolloutBatch:
        """The persisted rollouts of iteration k, which ``step`` trains on."""
        data = self.store().read_rollouts(k)
        if data is None:
            raise FileNotFoundError(
                f"no persisted rollouts for iteration {k} in run {self.run_name!r}; "
                f"run rollout({k}) before {step}"
            )
        return RolloutBatch.from_json(data)

    def _token_advantages(self, k: int) -> torch.Tensor | None:
        from training.critic_store import policy_advantages

        return policy_advantages(self.cfg.loss, self.storage_cfg, self.run_name, k)

    # Backend hooks of the step: the megatron actor overrides these two,
    # ``_data_parallel_size`` and ``_all_reduce_sums``.
    def _data_parallel_rank(self) -> int:
        return self.rank

    def _clip_grad_norm(self) -> float:
        """Clip by the global gradient norm; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def _reference_logprobs(self, mbs: list, temperature: float) -> tuple[list, list]:
        """Old logprobs and reference logprobs (when the KL term is on) at the batch's
        sampling ``temperature``; no autograd graph.

        On-policy (``rollout.max_staleness: 0``) the old logprobs are the current
        weights', which generated the batch, so the ratio starts at 1: ``None``
        here, and the training forward's own, detached, in ``_accumulate``.
        Off-policy they are the engines' own logprobs: the batch came from an
        older version than the trainer holds, and the ratio must correct for
        that (as slime's async training, verl's one-step-off-policy and prime-rl do).
        With ``train.loss.rollout_correction`` on they are the trainer's in both
        cases, and the correction's weights exp(trainer - engine) carry the rest
        (AReaL's decoupled PPO: the staleness as well as the kernels' mismatch).
        """
        old: list = []
        ref: list = []
        corrected = self.cfg.loss.rollout_correction.kind != "none"
        behaviour = self.sections.rollout.max_staleness > 0 and not corrected
        if not behaviour:
            # The step's weights themselves: one optimizer step per batch, so they are
            # what the training forward computes (``_accumulate`` detaches it), and a
            # forward pass of its own would only repeat it (a quarter of a CPU step).
            old = [None] * len(mbs)
        with_ref = self.cfg.loss.kl_coef > 0
        if not with_ref and not behaviour:
            return old, ref
        self.model.eval()
        with torch.no_grad():
            for mb in mbs:
                mb = self._to_device(mb)
                if behaviour:
                    old.append(mb.rollout_logprobs)
                if with_ref:
                    ref.append(self._kl_reference(mb, temperature))
        return old, ref

    def _kl_reference(self, mb: Any, temperature: float) -> torch.Tensor:
        """The KL reference's logprobs: the frozen base model, or with LoRA the policy
        with its adapters off (the base, without a second copy)."""
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, mb, temperature)[0]
        with lora.adapters_disabled(self._policy()) as base:
            return self._logprobs(base, mb, temperature)[0]

    def _logprobs(
        self, model: torch.nn.Module, mb: Any, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's logprobs (and entropy) at its loss positions, at ``temperature``."""
        return bt.token_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            temperature,
            positions=mb.loss_mask,
            with_entropy=with_entropy,
            entropy_grad=with_entropy and self.cfg.loss.entropy_coef > 0,
            packed=self.cfg.pack_sequences,
            kernel=pick_kernel(self.cfg.logprob_kernel, self.device),
        )

    def _accumulate(
        self, mbs: list, old: list, ref: list, global_tokens: int, temperature: float
    ) -> torch.Tensor:
        """Forward/backward each micro-batch at the batch's sampling ``temperature``;
        returns summed metrics for the all-reduce."""
        lc = self.cfg.loss
        policy = self._policy()
        policy.train()
        self._zero_grad()
        # Gradients are averaged over the data-parallel ranks (FSDP does it for the
        # torch backend), so each rank divides by G / dp.
        dp = self._data_parallel_size()
        denom = max(global_tokens, 1) / dp
        # [loss, pg_loss*n, clip_frac*n, kl*n, entropy*n, then each of MISMATCH*n, n], summed
        # on the device and read on the host once, after the all-reduce.
        sums = torch.zeros(6 + len(MISMATCH), dtype=torch.float64, device=self.device)
        for i, mb in enumerate(mbs):
            mb = self._to_device(mb)
            lp, ent = self._logprobs(policy, mb, temperature, with_entropy=True)
            loss, m = policy_loss(
                lc,
                lp,
                lp.detach() if old[i] is None else old[i],
                mb.advantages,
                mb.loss_mask,
                ref_logprobs=ref[i] if ref else None,
                entropy=ent,
                num_tokens=denom,
                # Equal rows per rank (rank_slice), so these rows are the global count / dp.
                num_sequences=sum(b.size for b in mbs),
                rollout_logprobs=mb.rollout_logprobs,
            )
            loss.backward()
            if self._compute is not None:
                self._compute.collect_grads()
            n = mb.loss_mask.sum()
            means = [m["pg_loss"], m["clip_frac"], m.get("kl", 0.0), m.get("entropy", 0.0)]
            means += [m[key] for key in MISMATCH]
            # A metric the loss did not compute is a Python 0.0: times n it stays on the
            # device (as_tensor would copy it there and wait for the stream to drain).
            row = [loss.detach() / dp, *(n * v for v in means)]
            sums += torch.stack([t.to(torch.float64) for t in [*row, n]])
        return self._all_reduce_sums(sums).cpu()

    def _data_parallel_size(self) -> int:
        """Ranks that see different data (all of them under FSDP)."""
        return self.world_size

    def _all_reduce_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Sum the metric sums over the data-parallel ranks."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(sums)  # on the rank's device: NCCL reduces only device tensors
        return sums

    def _metrics(self, sums: torch.Tensor, grad_norm: float, full: Any, secs: float) -> dict:
        n = max(float(sums[-1]), 1.0)
        tokens = int(full.attention_mask.sum())
        return {
            "iteration": self._iteration,
            "loss": float(sums[0]),
            "pg_loss": float(sums[1]) / n,
            "clip_frac": float(sums[2]) / n,
            "kl": float(sums[3]) / n,
            "entropy": float(sums[4]) / n,
            **{key: float(sums[5 + j]) / n for j, key in enumerate(MISMATCH)},
            "grad_norm": grad_norm,
            "reward_mean": float(full.rewards.mean()),
            "samples": full.size,
            "response_tokens": int(n),
            "tokens": tokens,
            "train_s": secs,
            "tokens_per_s": tokens / secs if secs > 0 else 0.0,
        }

    # -- helpers -----------------------------------------------------------
    def _policy(self) -> torch.nn.Module:
        """The module forwards and backwards run on: the master weights' compute-dtype
        copy, brought up to date, or the model itself."""
        if self._compute is None:
            return self.model
        self._compute.refresh()
        return self._compute.model

    def _zero_grad(self) -> None:
        self.optim.zero_grad(set_to_none=True)
        if self._compute is not None:
            self._compute.zero_grad()

    def _to_device(self, mb: Any) -> Any:
        if self.device.type == "cpu":
            return mb
        import dataclasses

        # From page-locked memory the copy is queued behind the step's kernels; from
        # pageable memory it would wait for them (a stall at every micro-batch).
        return dataclasses.replace(
            mb,
            **{
                f.name: getattr(mb, f.name).pin_memory().to(self.device, non_blocking=True)
                for f in dataclasses.fields(mb)
            },
        )

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("train actor has no model yet; call init_from_base(path) first")

    def _require_at(self, k: int, what: str) -> None:
        self._require_model()
        if self._iteration != k:
            raise StateMismatchError(
                f"{what} needs trainer state {k}, but rank {self.rank} holds "
                f"{self._iteration}; call TrainGroup.ensure_state({k}) first"
            )

"""The train actor of ``train.backend: megatron``: same interface as ``TrainActor``.

A ``TrainActor`` whose model is a megatron-core ``GPTModel`` (local spec, bf16
through ``Float16Module``) behind ``HFView``, so old/reference logprobs,
``score``, ``offload``/``onload`` and the shared GRPO loss are inherited
unchanged. What differs: process groups (``parallel_state``), weight loading
and export (through ``convert``), checkpoints (``training.megatron.checkpoint``;
export and checkpoints are the hooks the actor hands its ``DurableState``) and
the step, which slices data by the *data-parallel* rank (TP peers see the same
rows), all-reduces gradients over the data-parallel group and clips with a norm
that counts TP-sharded parameters across the TP group.

Optimizer: ``torch.optim.AdamW`` (fused, on the GPU), as the torch backend.
Megatron's ``DistributedOptimizer`` needs its ``DistributedDataParallel``
wrapper (contiguous ``main_grad`` buffers) and writes a per-rank sharded state
that only ``dist_checkpointing`` reads back. At TP = PP = 1 on one GPU it buys
nothing, while AdamW gives the same update maths and the same ``state_dict`` as
the torch backend, so checkpoints are a plain ``torch.save``. AdamW is
elementwise, so it is also correct on TP shards. Mixed precision
(``train.compute_dtype: bfloat16`` over ``model.dtype: float32``) is the torch
backend's at one rank: fp32 master parameters and optimizer state, a bf16 twin
model for the passes, gradients added into the master in fp32 (then reduced
over DP and clipped in fp32), checkpoints of the master.

GPU only: megatron's forward needs CUDA (``setup`` refuses a CPU device).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig

from training import backend_torch as bt
from training.actor import TrainActor
from training.megatron import checkpoint as mcheckpoint
from training.megatron.convert import spec_from_hf_config
from training.megatron.model import (
    HFView,
    build_gpt,
    check_layout,
    full_hf_state,
    init_parallel,
    iter_hf_tensors,
    load_hf_state,
    read_hf_state,
    wrap,
)
from training.mixed_precision import ComputeCopy


class MegatronTrainActor(TrainActor):
    # -- lifecycle ---------------------------------------------------------
    def setup(self) -> None:
        """Threads, determinism, torch.distributed and megatron's parallel_state."""
        if self.device.type != "cuda":
            raise ValueError(
                "train.backend: megatron needs CUDA (megatron-core's forward does not run on "
                "CPU); set train.num_gpus_per_worker: 1 on a GPU machine, or use train.backend: torch"
            )
        torch.set_num_threads(self.cfg.torch_threads)
        bt.set_determinism(self.device)
        mc = self.cfg.megatron
        init_parallel(
            self.rank,
            self.world_size,
            self.master_addr,
            self.master_port,
            mc.tensor_parallel,
            mc.pipeline_parallel,
            self.seed,
            self.device,
        )
        from megatron.core import parallel_state as ps

        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

    def _build(self, hf_cfg: Any, hf_state: dict[str, torch.Tensor] | None, dtype: str) -> HFView:
        """The model in ``dtype``, holding ``hf_state`` (None: as initialised, for a
        compute twin, which ``ComputeCopy`` fills from the master)."""
        mc = self.cfg.megatron
        gpt = build_gpt(hf_cfg, dtype, mc.tensor_parallel, mc.pipeline_parallel, self.device)
        view = wrap(gpt, hf_cfg, dtype)
        if hf_state is not None:
            load_hf_state(gpt, hf_state, self.tp, self.tp_rank)
        return view

    def init_from_base(self, model_path: str) -> int:
        """Build the megatron model (+ frozen reference when kl_coef > 0) and AdamW.
        With ``train.compute_dtype`` bfloat16 over fp32 weights, the model is the
        fp32 master and a second one, built bf16 through ``Float16Module``, runs the
        forwards and backwards (``ComputeCopy``): megatron's own mixed precision
        keeps fp32 main parameters in its optimizer, but accumulates micro-batch
        gradients in bf16 without its DDP wrapper; here they add up in fp32."""
        hf_cfg = AutoConfig.from_pretrained(model_path)
        mc = self.cfg.megatron
        check_layout(
            self.world_size, mc.tensor_parallel, mc.pipeline_parallel, spec_from_hf_config(hf_cfg)
        )
        hf_state = read_hf_state(model_path)
        dtype, compute = self.model_cfg.dtype, self.sections.compute_dtype
        self.model = self._build(hf_cfg, hf_state, dtype)
        if compute != dtype:
            twin = self._build(hf_cfg, None, compute)  # converted once: ComputeCopy copies
            self._compute = ComputeCopy(self.model, bt.DTYPES[compute], twin)
        if self.cfg.loss.kl_coef > 0:  # frozen: it scores in the compute dtype, as the policy does
            self.ref_model = self._build(hf_cfg, hf_state, compute)
            self.ref_model.requires_grad_(False).eval()
        self.optim = bt.adamw(self.model, self.cfg.lr, self.cfg.weight_decay, self.device)
        pad = getattr(hf_cfg, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.base_model_path = model_path
        self._iteration = 0
        return 0

    # -- durable state (the hooks TrainActor hands its DurableState) -------
    def _restore(self, store: Any, k: int) -> dict:
        return mcheckpoint.load(store, k, self.model.gpt, self.optim)

    def _checkpoint_snapshot(self, copy: bool, staging: Any) -> dict | None:
        # gathered and converted on rank 0 (``copy``: detached there); no reused host buffers
        return mcheckpoint.snapshot(self.model.gpt, self.optim, copy)

    def _checkpoint_meta(self) -> dict:
        return mcheckpoint.meta_extra()

    # -- training ----------------------------------------------------------
    def _data_parallel_rank(self) -> int:
        return self.dp_rank  # TP peers take the same slice and draw alike

    def _clip_grad_norm(self) -> float:
        norm = self._reduce_and_clip()
        torch.cuda.synchronize()
        return norm

    def _hf_state(self, staging: Any = None) -> dict[str, torch.Tensor]:
        # HF names, no lm_head when tied; converted copies already, so no staging
        return full_hf_state(self.model.gpt, self.tp)

    def _push_tensors(self) -> Any:
        """HF-named tensors converted layer by layer as a push streams them (the raw
        megatron state dict holds ``_extra_state`` entries and fused qkv / fc1)."""
        return iter_hf_tensors(self.model.gpt, self.tp)

    def _bindable_model(self) -> None:
        return None  # pushed tensors are converted copies (fused qkv, fc1), never the model's

    def _data_parallel_size(self) -> int:
        return self.dp_size  # gradients are averaged over DP in _reduce_and_clip

    def _all_reduce_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Metric sums over the data-parallel group (TP ranks hold the same data)."""
        if self.dp_size > 1:
            from megatron.core import parallel_state as ps

            dev = sums.to(self.device)
            dist.all_reduce(dev, group=ps.get_data_parallel_group())
            sums = dev.cpu()
        return sums

    def _reduce_and_clip(self) -> float:
        """Average gradients over DP, then clip by the global norm: TP-sharded
        parameters (megatron marks them ``tensor_model_parallel``) are summed over
        the TP group, replicated ones (norms) counted once. Returns the norm."""
        from megatron.core import parallel_state as ps

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp_size > 1:
            group = ps.get_data_parallel_group()
            for p in params:  # fixed order on every rank
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(self.dp_size)
        sharded = torch.zeros((), dtype=torch.float32, device=self.device)
        replicated = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            sq = p.grad.float().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False) and self.tp > 1:
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        norm = float((sharded + replicated).sqrt())
        coef = self.cfg.grad_clip / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

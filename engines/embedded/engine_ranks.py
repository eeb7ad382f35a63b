"""The ranks of an embedded engine that spans several devices (``engines.tp_size > 1``).

Owns ranks 1..tp-1: each is a Ray actor (``EngineRank``) on its own bundle of
the engine's placement group, holding its shard of the model
(``engines.embedded.tensor_parallel``) and joined to rank 0 by a process group (gloo on
CPU, NCCL on GPU) for the all-reduces inside each forward. Rank 0 is the
``EmbeddedEngine`` actor itself; it drives the others:

- every forward and cache edit of a decode call goes to every rank, in the
  same order (``TPRunner``; rank 0 submits under its step lock, and Ray runs a
  caller's tasks on an actor in submission order);
- every weight update is applied by every rank, each taking its own slice:
  from disk (read and checked by all ranks before any rank swaps), from
  tensor handles (rank j opens handle j, as SGLang's TP workers do), or by
  broadcast (each rank joins the trainer's group as ``rank_offset + j``).

The rank actors are owned by rank 0, so they die with it: restarting an engine
restarts all its ranks. Never decides versions and never serves HTTP.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.device_memory import DeviceMemory
from engines.config import EngineConfig
from engines.embedded import tensor_parallel as tpar
from engines.embedded.decode import ModelRunner
from engines.embedded.weight_cache import ReceiverCache
from engines.embedded.weight_files import read_state_dict, verify_dir
from engines.weights import check_state_dict, load_into
from wire import receiver as wr
from wire.errors import WeightLoadError


def wait_all(refs: list[Any]) -> list[Any]:
    """``ray.get(refs)``, except that no refs (a single-rank engine) never touches
    Ray: ``ray.get([])`` would start a Ray instance in an engine used in process."""
    return ray.get(refs) if refs else []


def engine_device(cfg: EngineConfig) -> torch.device:
    use_gpu = cfg.num_gpus_per_engine > 0 and torch.cuda.is_available()
    return torch.device("cuda" if use_gpu else "cpu")


def load_model(model_path: str, cfg: EngineConfig) -> torch.nn.Module:
    """The full HF model on this rank's device, in eval mode; a directory with a
    manifest.json is verified first (WeightIntegrityError: nothing is loaded)."""
    from transformers import AutoModelForCausalLM

    verify_dir(model_path)  # HF reads the files again, from the page cache
    device = engine_device(cfg)
    # float32 on CPU keeps a row's tokens independent of batch padding.
    dtype = "auto" if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


def group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class EngineRank:
    """Rank ``rank`` (>= 1) of one engine; every method is called by rank 0."""

    def __init__(
        self,
        model_path: str,
        cfg: EngineConfig,
        rank: int,
        master: tuple[str, int, str],
    ) -> None:
        torch.set_num_threads(cfg.torch_threads)
        self.rank, self.tp = rank, cfg.tp_size
        self._device = engine_device(cfg)
        self._model = load_model(model_path, cfg)
        addr, port, name = master
        self._group = wr.make_group(addr, port, rank, self.tp, name, group_backend(self._device))
        tpar.shard_model(self._model, rank, self.tp, self._group)
        self._runners: dict[str, ModelRunner] = {}
        self._staged: dict[str, torch.Tensor] | None = None
        self._update_groups: dict[str, Any] = {}
        self.cache = ReceiverCache()  # this rank's opened staging handles, kept across updates
        self.memory = DeviceMemory(self._device, "weights")  # sleeps with its engine

    def pid(self) -> int:
        return os.getpid()

    # ---- decode, mirrored from rank 0 ---------------------------------------

    def begin(self, sid: str) -> None:
        runner = ModelRunner(self._model)
        runner.begin()
        self._runners[sid] = runner

    @torch.inference_mode()
    def forward(self, sid: str, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> None:
        # The logits are rank 0's business; this rank only joins the all-reduces.
        d = self._device
        self._runners[sid].forward(ids.to(d), mask.to(d), pos.to(d))

    def select(self, sid: str, rows: torch.Tensor) -> None:
        self._runners[sid].select(rows.to(self._device))

    def end(self, sid: str) -> None:
        self._runners.pop(sid, None)

    # ---- weights ------------------------------------------------------------

    def stage_from_disk(self, model_path: str, roots: tuple[str, ...] | None = None) -> str | None:
        """Read (confined to ``roots``, verified against the manifest, as rank 0
        does) and check this rank's slice of ``model_path``; None when it fits."""
        try:
            state = tpar.shard_state(read_state_dict(model_path, roots), self.rank, self.tp)
            check_state_dict(self._model, state)
        except (WeightLoadError, OSError) as e:
            self._staged = None
            return f"rank {self.rank}: {e}"
        self._staged = state
        return None

    def commit_staged(self) -> None:
        assert self._staged is not None, "stage_from_disk first"
        load_into(self._model, self._staged)
        self._staged = None

    def drop_staged(self) -> None:
        self._staged = None

    def apply_handle(self, handle: dict[str, Any]) -> int:
        """Copy this rank's slice of one transfer handle's buckets into the model."""
        return self.cache.apply(self._model, handle, self._device, self.rank, self.tp)[1]

    def join_update_group(
        self, addr: str, port: int, rank: int, world: int, name: str, backend: str
    ) -> None:
        self.leave_update_group(name)
        self._update_groups[name] = wr.make_group(addr, port, rank, world, name, backend)

    def leave_update_group(self, name: str) -> None:
        pg = self._update_groups.pop(name, None)
        if pg is not None:
            wr.destroy_group(pg)

    def receive_update(self, name: str, metas: list[list[Any]]) -> int:
        buckets = wr.receive_bucket(self._update_groups[name], metas, self._device)
        return wr.copy_into(
            self._model, tpar.shard_named(wr.named_tensors(buckets), self.rank, self.tp)
        )

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's shard of the state dict, on CPU."""
        return {n: t.detach().to("cpu") for n, t in self._model.state_dict().items()}

    # ---- memory -------------------------------------------------------------

    def release(self) -> dict[str, Any]:
        return self.memory.sleep([self._model])

    def resume(self) -> dict[str, Any]:
        return self.memory.wake([self._model])


class EngineRanks:
    """Rank 0's handle on ranks 1..tp-1 of its engine."""

    def __init__(self, peers: list[Any], group: Any) -> None:
        self.peers = peers
        self.group = group  # rank 0's end of the tensor-parallel group

    @classmethod
    def start(
        cls, model_path: str, cfg: EngineConfig, engine_id: int, rank_bundles: list[int]
    ) -> EngineRanks:
        """Create the other ranks on ``rank_bundles`` of the caller's placement group
        and form the group (blocks until every rank has its model)."""
        if len(rank_bundles) != cfg.tp_size - 1:
            raise ValueError(
                f"engine {engine_id}: tp_size={cfg.tp_size} needs {cfg.tp_size - 1} rank bundles, "
                f"got {rank_bundles}"
            )
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                "an engine with tp_size > 1 must run in a placement group (EngineGroup places it)"
            )
        addr = ray.util.get_node_ip_address()
        master = (addr, wr.free_port(), f"engine-tp-{engine_id}-{uuid.uuid4().hex[:8]}")
        cls_remote = ray.remote(EngineRank)
        peers = [
            cls_remote.options(
                num_cpus=cfg.num_cpus_per_engine,
                num_gpus=cfg.num_gpus_per_engine,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, b),
            ).remote(model_path, cfg, j, master)
            for j, b in enumerate(rank_bundles, start=1)
        ]
        group = wr.make_group(
            master[0], master[1], 0, cfg.tp_size, master[2], group_backend(engine_device(cfg))
        )
        return cls(peers, group)

    def pids(self) -> list[int]:
        """Process ids of ranks 1..tp-1."""
        return ray.get(self.submit("pid"))

    def submit(self, method: str, *args: Any) -> list[Any]:
        """Start ``method(*args)`` on every other rank; returns the refs."""
        return [getattr(p, method).remote(*args) for p in self.peers]

    def submit_each(self, method: str, per_rank: list[tuple[Any, ...]]) -> list[Any]:
        """Start ``method(*per_rank[j-1])`` on rank j."""
        return [getattr(p, method).remote(*a) for p, a in zip(self.peers, per_rank, strict=True)]

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shards = [local, *ray.get(self.submit("state"))]
        return tpar.gather_state(shards)


class TPRunner(ModelRunner):
    """A decode call on rank 0 whose every forward and cache edit is repeated,
    in the same order, on the engine's other ranks (their all-reduces meet)."""

    def __init__(self, model: torch.nn.Module, ranks: EngineRanks) -> None:
        super().__init__(model)
        self.ranks = ranks
        self.sid = uuid.uuid4().hex

    def begin(self) -> None:
        refs = self.ranks.submit("begin", self.sid)
        super().begin()
        ray.get(refs)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        refs = self.ranks.submit("forward", self.sid, ids.cpu(), mask.cpu(), pos.cpu())
        logits = super().forward(ids, mask, pos)
        ray.get(refs)
        return logits

    def select(self, rows: torch.Tensor) -> None:
        refs = self.ranks.submit("select", self.sid, rows.cpu())
        super().select(rows)
        ray.get(refs)

    def end(self) -> None:
        refs = self.ranks.submit("end", self.sid)
        super().end()
        ray.get(refs)

"""Preparing a run: base model, lease, run.json, v0 and the Ray connection
(``tasks.cluster``: the configured address or a local cluster, nothing else).

Called once at the start of ``rl_training`` (and by the plain driver). It is
idempotent: on a resumed run it checks what exists instead of rewriting it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from tasks import lease as run_lease
from tasks import tracking_config
from tasks.cluster import check_address, connect_ray, start_local_ray
from tasks.config import ConfigError, RunConfig
from tasks.context import RunContext

__all__ = [
    "check_chat_template",
    "check_datasets",
    "check_run",
    "connect_ray",
    "prepare_run",
    "start_local_ray",
    "take_lease",
]

log = logging.getLogger("prefect_rl.prepare")

# Settings a continued run must keep: changing them would silently change what
# earlier iterations meant (other prompts, other seeds, another model).
FROZEN_KEYS = (
    "run.seed",
    "model.path",
    "model.warm_start",
    "rollout.task",
    "rollout.reward",
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "train.backend",
    "train.num_workers",
    # A LoRA run's checkpoints hold only its adapters: their shape and the base
    # weights they sit on must stay what the run began with.
    "train.lora",
)


# model.warm_start: calculator: supervised steps, and the version of what they learn
# from (bump it when rollout.tools.demonstrations or the steps change: the cache).
WARM_START_STEPS = 400
WARM_START_VERSION = 1


def base_model_path(cfg: RunConfig) -> str:
    """The local HF directory of v0: model.path, or the tiny model built offline."""
    if cfg.model.path:
        p = Path(cfg.model.path).expanduser()
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"model.path {str(p)!r} is not a local HF checkpoint (no config.json); "
                "give a directory written by save_pretrained (a random-init Qwen2.5-0.5B shape: "
                f"prefect-rl tiny-model --shape qwen2-0.5b {str(p)!r}), or leave model.path "
                "unset for the tiny model"
            )
        return str(p.resolve())
    name = f"tiny-model-seed{cfg.run.seed}"
    if cfg.model.warm_start == "calculator":  # the name changes whenever the demonstrations do
        name += f"-calculator-v{WARM_START_VERSION}"
    out = Path(os.path.expanduser("~/.cache/prefect-rl")) / name
    if not (out / "model.safetensors").is_file():
        # Imported only to build it: torch and transformers cost a flow process
        # ~4 CPU seconds, and a resumed run's process needs neither.
        from rollout.tools import demonstrations
        from training.tiny_model import WARM_START_BATCH, write_tiny_model

        demos = []
        if cfg.model.warm_start == "calculator":
            demos = demonstrations(WARM_START_STEPS * WARM_START_BATCH, cfg.run.seed)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write_tiny_model(tmp, seed=cfg.run.seed, demonstrations=demos)
        os.replace(tmp, out) if not out.exists() else None
    return str(out)


def code_version() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def _get(d: dict, dotted: str):
    for key in dotted.split("."):
        d = d.get(key, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def check_frozen(ctx: RunContext) -> dict | None:
    """Refuse a continued run whose frozen settings changed; the existing run.json."""
    store, cfg = ctx.store, ctx.cfg
    snapshot = cfg.model_dump(mode="json")
    existing = store.read_run_json()
    if existing is None:
        return None
    old = existing.get("config", {})
    # A key newer than the run's run.json had its default then (model.warm_start).
    default = RunConfig().model_dump(mode="json")
    was = {k: _get(old, k) if _get(old, k) is not None else _get(default, k) for k in FROZEN_KEYS}
    changed = [k for k in FROZEN_KEYS if was[k] != _get(snapshot, k)]
    if changed:
        raise ConfigError(
            f"run {cfg.run.name!r} in {store.url} was started with other settings for "
            + ", ".join(f"{k} (was {was[k]!r}, now {_get(snapshot, k)!r})" for k in changed)
            + "; keep them, or start a new run with another run.name"
        )
    return existing


def check_or_write_run_json(ctx: RunContext) -> None:
    if check_frozen(ctx) is None:
        ctx.store.write_run_json(
            {
                "config": ctx.cfg.model_dump(mode="json"),
                "code_version": code_version(),
                "created_at": datetime.now(timezone.utc).isoformat(),
            }
        )


def publish_base(ctx: RunContext) -> None:
    """v0 is the base model, published like any other version."""
    store = ctx.store
    if 0 in store.committed_versions():
        return
    writer = store.weights_writer(0, iteration=0, parent=None)
    base = Path(ctx.base_model_path)
    for f in sorted(base.iterdir()):
        if f.is_file():
            writer.add_file(f.name, str(f))
    writer.commit()


def check_datasets(cfg: RunConfig) -> None:
    """Read every row of each dataset file the run will read (rollout.task, and
    eval.dataset when evaluation is on) as its loader will: a bad row found only
    in rollout[k=1] would come after the lease, run.json and v0, and run.json
    would freeze the bad path. Raises ConfigError naming the key, file and line."""
    from rollout.builtin_tasks import BUILTIN_TASKS
    from rollout.datasets import DatasetError, load_prompts
    from rollout.rewards import LABEL_CHECKS

    files = {"rollout.task": cfg.rollout.task}
    if cfg.eval.interval > 0 and cfg.eval.dataset is not None:
        files["eval.dataset"] = cfg.eval.dataset
    for key, path in files.items():
        if path in BUILTIN_TASKS:
            continue
        try:
            # The reward's own form of label (math: a number or '#### N'), row by row.
            check = LABEL_CHECKS.get(cfg.rollout.reward)
            load_prompts(path, cfg.rollout.input_key, cfg.rollout.label_key, key, check)
        except DatasetError as e:
            raise ConfigError(str(e)) from None


def check_chat_template(cfg: RunConfig, path: str) -> None:
    """With rollout.chat_template, render a prompt (and in multi-turn episodes an
    observation) through the base model's template as rollout does: a tokenizer
    without one, or a template that does not render, would otherwise fail
    rollout[k=1] after the lease and v0."""
    if not cfg.rollout.chat_template:
        return
    from transformers import AutoTokenizer  # only here: seconds of import a plain run skips

    from rollout.datasets import encode_observation, encode_prompt

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        encode_prompt(tokenizer, "What is 2 + 3?", chat_template=True)
        if cfg.rollout.environment != "none":  # episodes render the turns after the first
            encode_observation(tokenizer, ":5.", chat_template=True, ended=True)
    except Exception as e:  # jinja's TemplateError, DatasetError, a tokenizer that won't load
        raise ConfigError(
            f"rollout.chat_template is on, but the chat template of {path} does not render "
            f"({type(e).__name__}: {e}); fix its tokenizer's chat template, or set "
            "rollout.chat_template: false"
        ) from None


def check_run(cfg: RunConfig, inputs: bool = True) -> str:
    """Everything that can be checked before any state is written: the storage
    root, the frozen settings of a continued run, the base model, every row of
    the datasets, the trackers' folders and server, a Ray cluster at
    ``ray.address`` answering. (The config schema, the reward and the node
    resources were checked when ``cfg`` was loaded.) Returns the base model
    path. Raises ConfigError, StorageError or ValueError naming the key and fix.

    ``inputs=False`` leaves out the datasets and trackers: a maintenance flow on
    an existing run reads neither, and a moved dataset or a stopped tracking
    server must not block a gc or a reload."""
    from storage.fs import check_root

    check_root(cfg.storage)  # credentials in the URL, a file, not writable, a missing bucket
    path = base_model_path(cfg)
    check_frozen(RunContext(cfg=cfg, base_model_path=path))
    if inputs:
        check_datasets(cfg)
        check_chat_template(cfg, path)
        # An enabled tracker without its package, a folder it cannot write, a silent server.
        tracking_config.check(cfg)
        warn_precision_gap(cfg, path)  # a run that trains, not a maintenance flow
        check_lora_targets(cfg, path)
    if cfg.ray.address is not None:
        check_address(cfg.ray.address)  # a dead cluster fails in seconds, before any lease
    return path


def check_lora_targets(cfg: RunConfig, path: str) -> None:
    """``train.lora.target_modules`` against the base model's linear layers, on a model
    built on the meta device (no weights read): a name it lacks would otherwise fail
    train[k=1] after the lease, v0 and the first rollout."""
    if cfg.train.lora is None:
        return
    import torch  # only here: a run without LoRA never pays for the import
    from transformers import AutoConfig, AutoModelForCausalLM

    from training.lora import missing_targets

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    except Exception:  # the trainer's own load reports a model that will not build
        return
    problem = missing_targets(cfg.train.lora, model)
    if problem:
        raise ConfigError(f"{problem} ({path}); name those layers, or remove train.lora")


def warn_precision_gap(cfg: RunConfig, path: str) -> str | None:
    """One WARNING when SGLang serves the base model's bf16 while the trainer computes
    in fp32: the two then score different weights (an fp32 step of 1e-5 mostly
    vanishes in bf16 rounding), and ``rollout_logprob_kl`` grows as the run learns.
    Returns the warning, None when there is no gap."""
    from training.config import TrainerSections

    if cfg.engines.kind != "sglang" or TrainerSections.of(cfg).compute_dtype != "float32":
        return None
    args = [a.replace("=", " ") for a in cfg.engines.sglang.extra_args]
    if "--dtype float32" in " ".join(args):
        return None
    try:
        hf = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the engine's own start reports an unreadable model
    served = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if served == "float32":
        return None
    message = (
        f"the trainer computes in float32 while SGLang serves {path} in {served}: the engines "
        "sample from weights the trainer never scores (the gap grows as the run learns; "
        "rollout_logprob_kl shows it). Set train.compute_dtype: bfloat16 (fp32 master "
        "weights, bf16 forward and backward), or add --dtype float32 to "
        "engines.sglang.extra_args"
    )
    log.warning(message)
    return message


def take_lease(ctx: RunContext, force: bool = False, wait: bool = True) -> RunContext:
    """Acquire the run's lease; the context carrying its fence, so every store
    rebuilt from it (in this process or a Ray worker) commits only while it holds.
    ``wait=False`` refuses at once when a holder may be alive, instead of watching
    its renewals for a TTL (maintenance flows: an operator wants the answer now)."""
    lease = ctx.store.acquire_lease(ctx.owner, ctx.cfg.storage.lease_ttl_s, force=force, wait=wait)
    ctx = dataclasses.replace(ctx, fence=lease.fence)
    # Renewed from now on, not from when the flow's LeaseKeeper starts: a taker
    # watching a holder that writes run.json and v0 silently would take it over.
    run_lease.hold(ctx)
    return ctx


def prepare_run(cfg: RunConfig, force_lease: bool = False) -> RunContext:
    # Validate first: a refused run leaves no lease, run.json or version behind
    # (a run.json written before a refusal would freeze the refused settings).
    # Joining Ray checks the cluster's CPUs, GPUs and pinned node resources: before
    # the lease too, so a cluster that cannot hold the run leaves nothing behind.
    ctx = RunContext(cfg=cfg, base_model_path=check_run(cfg))
    connect_ray(cfg)
    ctx = take_lease(ctx, force=force_lease)
    try:
        check_or_write_run_json(ctx)
        publish_base(ctx)
    except BaseException:
        # The run never started: the next one (or a maintenance flow) may write at once.
        run_lease.release(ctx)
        raise
    return ctx


def config_digest(cfg: RunConfig) -> str:
    return hashlib.sha256(
        json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()
    ).hexdigest()[:12]

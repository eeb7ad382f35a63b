"""Engines section of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from actors.resources import check_node_resource


class SGLangConfig(BaseModel):
    """How ``engines.kind: sglang`` launches ``python -m sglang.launch_server``."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="--host of each server")
    port: int = Field(
        0, ge=0, le=65535, description="--port of engine 0 (i adds i); 0 = a free port"
    )
    mem_fraction_static: float | None = Field(
        None, gt=0, le=1, description="--mem-fraction-static (None: SGLang's default)"
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More launch_server arguments, passed as given"
    )
    cuda_graph_max_bs: int | None = Field(
        None,
        ge=1,
        description="--cuda-graph-max-bs: capture CUDA graphs only up to the batch a run "
        "decodes (rollout rows per engine), which shortens startup; None: SGLang's default",
    )
    pythonpath: list[str] = Field(
        default_factory=list,
        description="Folders put first on the server's PYTHONPATH: SGLang's own environment "
        "when it differs from the trainer's (its transformers and pydantic pins)",
    )
    launch_command: list[str] | None = Field(
        None,
        description="Command before the arguments; default [python, -m, sglang.launch_server]",
    )
    startup_timeout_s: float = Field(900.0, gt=0, description="Deadline for /health_generate")
    stop_timeout_s: float = Field(30.0, gt=0, description="SIGTERM grace before SIGKILL")
    log_dir: str | None = Field(None, description="Server logs go here (default: a temp dir)")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["embedded", "sglang"] = Field(
        "embedded",
        description="embedded: a torch engine inside the Ray actor (CPU runs, tests); sglang: the "
        "actor runs a real SGLang server (GPU)",
    )
    num_engines: int = Field(
        1, ge=1, description="Engines, each a Ray actor (per rank) on its own placement bundle"
    )
    tp_size: int = Field(
        1,
        ge=1,
        description="Ranks per engine (tensor parallel): one placement bundle each; "
        "SGLang's --tp-size",
    )
    num_cpus_per_engine: float = Field(1.0, gt=0, description="Ray CPUs reserved per engine")
    num_gpus_per_engine: float = Field(
        0.0, ge=0, description="Ray GPUs reserved per engine rank (fractional: shares a GPU)"
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads inside an engine")
    max_batch_size: int = Field(256, ge=1, description="Sequences decoded together")
    local_cache_dir: str | None = Field(
        None,
        description="Pull each version here before reloading (needed for remote storage): a "
        "path on each engine node's own disk, '~' expanded there; engines of one node share "
        "one pull of a version",
    )
    node_resource: str | None = Field(
        None,
        description="Pin engines to the nodes offering this custom Ray resource (ray start "
        "--resources='{\"engine_host\": 1}'); each engine bundle asks for 0.001 of it. "
        "None: any node",
    )
    pause_mode: Literal["abort", "in_place", "retract"] = Field(
        "in_place",
        description="How a weight update pauses generation: abort ends running requests; "
        "in_place parks them; retract drops their KV cache and re-prefills them on continue",
    )
    health_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Deadline of a health check, and of each stage of an engine's start "
        "(placement, actor creation, model_info)",
    )
    request_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="A generate request still unfinished this long after it was queued "
        "(paused time included) ends with finish reason abort",
    )
    context_length: int | None = Field(
        None,
        ge=1,
        description="Longest prompt + max_new_tokens a request may ask for; None: the "
        "model's max_position_embeddings (a larger value is the user's choice, as "
        "SGLang's --context-length)",
    )
    allowed_weight_roots: list[str] = Field(
        default_factory=list,
        description="Dirs /update_weights_from_disk may load from (plus the start model's dir)",
    )
    api_key_env: str = Field(
        "PREFECT_RL_ENGINE_API_KEY",
        description="Env var holding the bearer token of the admin endpoints (never in config)",
    )
    sglang: SGLangConfig = SGLangConfig()

    @field_validator("node_resource")
    @classmethod
    def _custom_resource(cls, v: str | None) -> str | None:
        return check_node_resource("engines.node_resource", v)


class PlacementConfig(BaseModel):
    """Where engines and train ranks run (the ``placement`` section).

    It lives with the engines because the engine group owns it: disaggregated
    (each engine in its own placement group, the trainer in another) or
    colocated (one shared group; the two sides take turns on its devices).
    """

    model_config = ConfigDict(extra="forbid")

    colocate: bool = Field(
        False,
        description="Train ranks and engine ranks share devices, one placement bundle per "
        "device, and take turns: engines sleep while the trainer works and the reverse",
    )

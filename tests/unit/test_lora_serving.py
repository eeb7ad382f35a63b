"""What ``train.lora`` asks of serving, checked before anything starts: settings that
cannot publish or serve adapter versions are refused at load with the fix named, and
an SGLang server is launched with the LoRA limits the config implies."""

from __future__ import annotations

import pytest

from engines.config import SGLangConfig
from engines.sglang.server import launch_args
from flows.config import ConfigError, load_config
from tasks.context import RunContext

LORA = ["train.lora.rank=8", "train.lora.target_modules=[q_proj, v_proj]"]


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["weights.delta=on"], "set weights.delta: off"),
        (["weights.transport=distributed"], "use weights.transport: tensor, disk or object-store"),
        (["engines.tp_size=2"], "set engines.tp_size: 1, or remove train.lora"),
        (
            ["engines.kind=sglang", "rollout.environment=calculator"],
            "set rollout.environment: none",
        ),
    ],
)
def test_settings_that_cannot_serve_adapters_are_refused_at_load(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*LORA, *sets])
    load_config(None, sets)  # each is fine without LoRA


def test_sglang_is_launched_with_the_lora_limits_the_config_implies(tmp_path):
    cfg = load_config(None, [*LORA, "rollout.max_staleness=2", f"storage.root={tmp_path}"])
    adapters = RunContext(cfg=cfg, base_model_path=str(tmp_path)).adapters()
    args = launch_args("/m", SGLangConfig(), 1, 30000, 0, adapters=adapters)
    flags = " ".join(args)
    assert "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj" in flags
    # the versions rollouts may still sample from, plus the one being loaded
    assert "--max-loras-per-batch 4 --max-loaded-loras 4" in flags
    assert "--enable-lora" not in launch_args("/m", SGLangConfig(), 1, 30000, 0)
    without = load_config(None, [f"storage.root={tmp_path}"])
    assert RunContext(cfg=without, base_model_path=str(tmp_path)).adapters() is None

"""``train.compile_layers``: compiled decoder layers are a GPU speed-up; CPU runs
keep HF's eager layers (the reference, whose bytes the resume tests compare), and
a backend that builds its own layers refuses the setting by name."""

from __future__ import annotations

import pytest
import torch

from training.backend_torch import should_compile_layers
from training.config import TrainConfig


def test_auto_compiles_on_cuda_only():
    assert TrainConfig().compile_layers == "auto"
    assert should_compile_layers("auto", torch.device("cpu")) is False
    assert should_compile_layers("on", torch.device("cpu")) is True
    assert should_compile_layers("off", torch.device("cuda")) is False
    # several ranks (FSDP2): eager unless asked, where it has not been measured
    assert should_compile_layers("auto", torch.device("cuda"), world_size=2) is False
    assert should_compile_layers("on", torch.device("cuda"), world_size=2) is True
    # LoRA: eager unless asked (compiled layers scored SGLang's samples 7x further off)
    assert should_compile_layers("auto", torch.device("cuda"), lora=True) is False
    assert should_compile_layers("on", torch.device("cuda"), lora=True) is True


def test_megatron_refuses_compile_layers_on():
    with pytest.raises(ValueError, match="compile_layers: on needs backend: torch"):
        TrainConfig(backend="megatron", compile_layers="on")
    # the default (auto) still loads: megatron builds its layers and leaves them eager
    assert TrainConfig(backend="megatron").compile_layers == "auto"

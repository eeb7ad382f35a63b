"""``train.backend: megatron``: megatron-core GPTModel training behind the train-actor interface.

Contracts:
- ``MegatronTrainActor`` (``actor.py``) is a ``TrainActor``: same methods
  (``train_step``, ``save_checkpoint``, ``load_checkpoint``, ``export_hf``,
  ``offload``/``onload``, ``score``), same run-store layout, same GRPO loss.
  ``TrainGroup`` picks it when ``train.backend == "megatron"``; ``ensure_state``
  is unchanged.
- Llama and Qwen2 only (RMSNorm, SwiGLU, RoPE, GQA, Qwen2 QKV bias), local
  layer spec (no Transformer Engine), bf16 through ``Float16Module``.
  GPU only; TP x DP written for N GPUs, PP must be 1.
- ``convert.py`` is pure torch (no megatron import): exact HF <-> Megatron
  mapping and TP split/gather; CI tests it without megatron-core.
- Published weights and checkpoint model files are plain HF safetensors, so
  engines and recovery do not care which backend trained.
- Imports torch, transformers, megatron-core (lazily, except ``convert``) and
  ``storage``; never Prefect.
"""

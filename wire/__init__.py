"""The weight wire: how a version's tensors travel from the trainer to an engine.

Both sides import it and it imports neither, so ``training`` and ``engines`` stay
siblings. Torch only; never Prefect or Ray.

- ``flat_bucket``: tensors packed into one flat uint8 buffer per bucket, with each
  tensor's name, dtype, shape and offset (SGLang's ``flattened_bucket`` layout).
- ``flat_binding``: a model's parameters bound as views of long-lived flat
  buffers, so an update lands by one copy per bucket.
- ``receiver``: the engine side of a tensor hand-off (CUDA IPC and shared-memory
  handles, gloo/NCCL broadcast groups); every handle is checked before any
  parameter changes.
- ``safe_pickle``: the one unpickler of bytes from outside, by allow-list.
- ``update_socket``: the local socket a trainer uses to tell an engine on the
  same host that a staged version is ready.
- ``sglang_payload``: the request bodies SGLang 0.5.17 takes for a tensor update.
- ``lora``: LoRA adapters as both sides exchange them (peft's names, the scale,
  the merge, the names ``v{k}`` versions are served under, tensor checksums).
- ``errors``: what a failed load raises (``WeightLoadError`` and its kinds); a
  failed load leaves the old version serving.
"""

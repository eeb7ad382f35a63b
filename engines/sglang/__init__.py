"""``engines.kind: sglang``: one real SGLang server per engine actor.

Modules (this ``__init__`` imports nothing: ``wire`` is read by the trainer,
which must not pull in the actor):

- ``server``: the ``python -m sglang.launch_server`` process: its command line
  (from ``engines.sglang``), log, readiness, a clean stop, death with the actor.
- ``engine``: ``SGLangEngine``, the Ray actor that owns one server and answers
  the embedded engine's Ray methods (``generate``, ``update_weights_from_*``,
  ``pause_generation`` ...) by calling that server over HTTP, so ``EngineGroup``
  and the weight transports drive both kinds alike.
- ``wire``: SGLang's in-memory weight formats (the ``flattened_bucket`` tensor
  payload and the broadcast layout), built without importing SGLang, whose
  environment differs from the trainer's.

Contracts: the admin token is always passed to the server and never logged; a
server that fails to start fails the engine's start with its command and last
log lines; an endpoint the server lacks is reported with the server's version
(the API driven is SGLang 0.5.x, tested on 0.5.17).
"""

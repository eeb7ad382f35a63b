"""``engines.kind: sglang``: one real SGLang server per engine actor.

Modules (SGLang's in-memory weight formats, which the trainer builds too, are
``wire.sglang_payload``):

- ``server``: the ``python -m sglang.launch_server`` process: its command line
  (from ``engines.sglang``), log, readiness, a clean stop, death with the actor.
- ``engine``: ``SGLangEngine``, the Ray actor that owns one server and answers
  the embedded engine's Ray methods (``generate``, ``update_weights_from_*``,
  ``pause_generation`` ...) by calling that server over HTTP, so ``EngineGroup``
  and the weight transports drive both kinds alike.

Contracts: the admin token is always passed to the server and never logged; a
server that fails to start fails the engine's start with its command and last
log lines; an endpoint the server lacks is reported with the server's version
(the API driven is SGLang 0.5.x, tested on 0.5.17).
"""

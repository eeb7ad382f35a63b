"""Ray actor plumbing that the train group and the engine group both use.

Imports ray and torch, never Prefect, and nothing of ``training`` or ``engines``.

- ``placement``: placement groups, colocation bundles and node pinning
  (``SharedPlacement``); names are ``{run}/...-pg``.
- ``resources``: the custom Ray resources that pin a side to its hosts.
- ``deadline``: ``ray.get`` with a deadline that names the actor that missed it.
- ``history``: whether a named actor ran before (a first start or a restart).
- ``device_memory``: release and resume of an actor's device memory (sleep and
  wake), on GPU with torch_memory_saver and on CPU by moving to host memory.
- ``options``: the concurrency groups every engine actor is declared with.
"""

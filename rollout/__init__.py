"""rollout: what the engines are asked and how their answers are scored.

Owns the prompt datasets and synthetic tasks, the per-sample seeds, reward
functions, the rollout procedure (``rollout.procedure``: prompts to a checked,
scored ``RolloutBatch``) and the wire types (``rollout.types``).

May import: storage, pydantic, stdlib. Must never import prefect, ray,
engines, training, tasks or flows: the engines are reached through the
``GenerateGroups`` callable the caller passes in.
"""

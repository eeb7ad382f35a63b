"""rollout: what the engines are asked and how their answers are scored.

Owns the prompt datasets and synthetic tasks (arithmetic word problems for
instruct models in ``rollout.arithmetic``), the per-sample seeds, reward
functions (the ``math`` reward's answer extraction in ``rollout.math_answer``) and the reward-server client (``rollout.remote_reward``), the rollout
procedure (``rollout.procedure``: prompts to a checked, scored
``RolloutBatch``), multi-turn episodes (``rollout.agent``, environments in
``rollout.environments``, the calculator tool in ``rollout.tools``), each
prompt's failure budget (``rollout.failures``) and the wire types
(``rollout.types``).

May import: storage, pydantic, stdlib. Must never import prefect, ray,
engines, training, tasks or flows: the engines are reached through the
``GenerateGroups`` callable or the ``TurnEngines`` object the caller passes in.
"""

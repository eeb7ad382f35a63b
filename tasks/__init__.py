"""tasks: the steps of an RL iteration and the Prefect tasks that run them.

Read ``tasks/steps.py`` (each step's declaration and logic), ``tasks/plan.py``
(one iteration's DAG, written once, and ``walk``, which runs it) and
``tasks/runner.py`` (every cross-cutting concern a step gets: ledger first,
timing, colocation turn, fault point, warnings, commit). ``rl_tasks`` / ``maintenance`` are the Prefect tasks; ``engines``
holds the weight transports and engine glue, ``colocate`` the device turns,
``verify`` the one version check, ``rollout_file`` the error for a persisted
rollout that training cannot use, ``types`` the typed records.

May import: storage, engines, training, rollout, prefect, ray. The flows package
is above it and never imported here (``RunConfig`` lives in ``tasks.config``).
Prefect only in ``rl_tasks`` and ``maintenance``: the runner, the plan and the
steps run without it.
"""

"""tasks: the steps of an RL iteration and the Prefect-free runtime that runs them.

Read ``tasks/steps.py`` (each step's declaration and logic), ``tasks/plan.py``
(one iteration's DAG, written once, and ``walk``, which runs it) and
``tasks/runner.py`` (every cross-cutting concern a step gets: ledger first,
timing, colocation turn, fault point, warnings, commit). Grouped by concept:

    serving/      which version each engine serves and how it gets there: the
                  weight transports, one engine's HTTP control, published
                  versions, the one version check
    rollouts/     what the rollout steps need: which weights make which batch,
                  the cluster's services, partial rollouts, an unusable batch
    evaluation/   the evaluate step and the evaluate-versions flow's plan,
                  engines and record
    colocate, phases, faults, metrics_row, types    what the runner and the
                  steps share: device turns, timed parts, fault injection and
                  kill targets, the metrics row, the typed records
    config, context, prepare, cluster, lease, retention, reaper, tracking
                  the run around the steps: its config, handle, setup, Ray,
                  single-writer lease, retention, process reaping, trackers

May import: storage, rollout, wire, actors, engines, training, ray. Never
Prefect, never flows (``RunConfig`` lives in ``tasks.config``): the plain driver
runs every step without Prefect, and the Prefect tasks that wrap them are in
``flows`` (``flows.step_tasks``, generated from the step declarations).
"""

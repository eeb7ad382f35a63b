"""tasks.evaluation: scoring weight versions on held-out prompts.

Two users, one scorer (``rollout.evaluation``):

    step      the iteration's ``evaluate`` step (``eval.interval``): pass@1 and
              pass@k of what the run's engines serve after iteration k
    plan      what an evaluation of published versions will do, decided before
              anything starts: the versions, the prompts' shards, each shard's key
    engines   that evaluation's own engine group, loaded version by version, and
              one shard's scoring through it
    record    where its results go besides the UI: ``evals/{label}.json`` and the
              run's trackers

``record`` and ``engines`` read ``plan``; ``step`` reads neither. The
evaluate-versions flow and its Prefect tasks (``flows.evaluation``,
``flows.evaluation_tasks``) drive the last three. No Prefect here.
"""

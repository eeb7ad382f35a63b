"""tasks.rollouts: what the rollout steps need beyond the procedure (``rollout/``).

    versions   which weights generate which batch: a function of the config
    services   what a rollout reaches through the cluster: engines' HTTP turns,
               reward scoring on Ray tasks, the failure log in the ledger
    partial    partial rollouts as a step (``rollout_head``) and the
               continuation the rollout step makes of its head
    unusable   a persisted batch that training cannot use, named with the way out

``partial`` reads ``versions`` and ``services``; the others read nothing of the
package. The rollout step itself is declared with the others in ``tasks.steps``.
No Prefect here.
"""

"""tasks.serving: which weight version each engine serves, and how it gets there.

Calls go one way, from the top down:

    transports   how weights reach the engines (``weights.transport``): where a
                 version's files are on an engine's node, a dead engine restarted,
                 one engine brought to a version by a reload from disk or a push
    verify       the one check that an engine serves the version it should
    versions     which version the ledger calls published, made readable again
                 when damaged; a committed checkpoint published as a version
    engine       one engine over its HTTP protocol: its client, the version it
                 serves, an update bracketed by pause and continue

``transports`` calls ``versions`` and ``engine``; ``verify`` calls ``engine``;
``versions`` and ``engine`` call nothing of the package. The steps, the
evaluation and the maintenance flows come from above; no module here imports a
step, the plan or Prefect.
"""

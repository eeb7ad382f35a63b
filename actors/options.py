"""The Ray actor shape every engine kind shares: threaded ``generate`` calls beside a
control group, so a pause, reload or health check is never queued behind generation.

Concurrency groups can only be set in ``ray.remote``, not ``.options``; the group
adds placement, name and lifetime with ``.options``.
"""

from __future__ import annotations

CONTROL_GROUP = "control"  # the concurrency group of every call that is not generate
GENERATE_CONCURRENCY = 8  # generate calls served at once (each a batch of rows)
CONTROL_CONCURRENCY = 4  # control calls served at once

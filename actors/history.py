"""Whether a named actor ran before in this Ray cluster: what tells a first
start (logged as INFO, "starting") from a restart after a death (a WARNING).

Ray forgets a dead actor's name (``ray.get_actor`` fails as for one that never
existed) but its GCS keeps every actor's record, name included, dead ones too
(up to ``RAY_maximum_gcs_destroyed_actor_cached_count`` of them). That table is
read through ``ray._private.state``: Ray's public state API needs the
dashboard, which our clusters run without. A cluster started anew (a resumed
run's local cluster) remembers nothing: its actors start for the first time
there. On a long-lived cluster, a run continued under the same name after its
actors were shut down also reads as a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


def ran_before(names: Iterable[str]) -> bool:
    """True if an actor of any of ``names`` is recorded in this cluster, alive or
    dead (a kill is asynchronous: just after one the record may not read DEAD
    yet), or if that cannot be told: a real restart must not be logged as a
    first start."""
    wanted = set(names)
    try:
        from ray._private import state

        table = state.actors()
    except Exception as e:  # a Ray without this table: warn as before rather than hide a death
        log.debug("Ray's actor table is unavailable (%s): assuming a restart", e)
        return True
    return any(info.get("Name") in wanted for info in table.values())

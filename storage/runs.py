"""The runs under a storage root and the state of each, for ``prefect-rl runs``.

Read-only: it lists ``{root}/*/run.json`` and reads each run's metrics,
versions, lease and serving records through ``RunStore``. What an engine
serves is the version the run last recorded for it (``engines/engine_i.json``),
not a live answer: a reader holds no Ray connection (no prefect, ray or torch
here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from storage.config import StorageConfig
from storage.fs import ls_names, open_root, read_json
from storage.layout import RUN_JSON
from storage.run_store import RunStore


@dataclass(frozen=True)
class RunState:
    name: str  # the run folder under the root
    iterations: int  # iterations committed (metrics rows)
    newest_version: int | None  # newest committed weights version
    lease: str  # "free", "released", or "held by <owner> (live|stale)"
    serving: dict[int, int]  # engine -> version it was last pointed at


def lease_text(store: RunStore, now: float) -> str:
    lease = store.read_lease()
    if lease is None:
        return "free"
    if lease.released:
        return "released"
    # expires_at is the holder's clock: shown as a hint only (takeover never trusts it)
    return f"held by {lease.owner} ({'live' if lease.live(now) else 'stale'})"


def list_runs(cfg: StorageConfig) -> list[RunState]:
    """Every run under ``cfg.root`` (a folder with a run.json), by name."""
    fs, url = open_root(cfg.root, cfg.s3)
    now = time.time()
    out = []
    for name in sorted(ls_names(fs, url)):
        snapshot = read_json(fs, f"{url}/{name}/{RUN_JSON}")
        if not isinstance(snapshot, dict):
            continue
        try:
            store = RunStore(cfg, name)
        except ValueError:  # a folder whose name is no run name
            continue
        versions = store.committed_versions()
        out.append(
            RunState(
                name=name,
                iterations=len(store.read_metrics()),
                newest_version=versions[-1] if versions else None,
                lease=lease_text(store, now),
                serving=store.serving_versions(),
            )
        )
    return out


def table(runs: list[RunState]) -> str:
    """One line per run, for a terminal."""
    if not runs:
        return "no runs (no folder with a run.json)"
    rows = [("run", "iterations", "newest", "lease", "engines (version served)")]
    for r in runs:
        engines = ", ".join(f"e{e}=v{v}" for e, v in sorted(r.serving.items())) or "-"
        newest = "-" if r.newest_version is None else f"v{r.newest_version}"
        rows.append((r.name, str(r.iterations), newest, r.lease, engines))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows
    )

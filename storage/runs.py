"""The runs under a storage root and the state of each, for ``prefect-rl runs``.

Read-only: it lists the folders of ``{root}`` that hold a run.json and reads
each run's metrics, versions, lease and serving records through ``RunStore``.
What an engine serves is the version the run last recorded for it
(``engines/engine_i.json``), not a live answer: a reader holds no Ray
connection (no prefect, ray or torch here).

Each run is read on its own and each of its records alone: a torn or foreign
file is listed as damaged beside what did read, so one broken run (or a plain
file in the root, such as a log) never hides the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from storage.config import StorageConfig
from storage.errors import StorageError
from storage.fs import open_root
from storage.layout import LEASE_JSON, RUN_JSON, TMP_PREFIX, check_run_name
from storage.run_store import RunStore

log = logging.getLogger("storage")

T = TypeVar("T")


@dataclass(frozen=True)
class RunState:
    name: str  # the run folder under the root
    iterations: int  # iterations committed (metrics rows that read)
    newest_version: int | None  # newest committed weights version
    lease: str  # "free", "released", "held by <owner> (live|stale)" or "damaged lease.json"
    serving: dict[int, int]  # engine -> version it was last pointed at (records that read)
    damaged: tuple[str, ...] = ()  # run-relative files that could not be read


def lease_text(store: RunStore, now: float) -> str:
    lease = store.read_lease()
    if lease is None:
        return "free"
    if lease.released:
        return "released"
    # expires_at is the holder's clock: shown as a hint only (takeover never trusts it)
    return f"held by {lease.owner} ({'live' if lease.live(now) else 'stale'})"


def _folders(cfg: StorageConfig) -> list[str]:
    """Names of the folders directly under the root (plain files, staging skipped)."""
    fs, url = open_root(cfg.root, cfg.s3)
    try:
        entries = fs.ls(url, detail=True)
    except FileNotFoundError:
        return []
    names = (
        str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
        for e in entries
        if e.get("type") == "directory"
    )
    return sorted(n for n in names if n and not n.startswith(TMP_PREFIX))


def read_run(cfg: StorageConfig, name: str) -> RunState | None:
    """The state of run ``name``; None when the folder holds no run.json or its name is
    no run name. Every record that does not read is named in ``damaged``."""
    try:
        store = RunStore(cfg, check_run_name(name))
    except ValueError:  # a folder whose name is no run name
        return None
    if not store.exists():
        return None
    damaged: list[str] = []

    def part(what: str, read: Callable[[], T], empty: T) -> T:
        try:
            return read()
        except (StorageError, OSError, ValueError, TypeError, KeyError) as e:
            log.warning("run %s: %s does not read (%s)", name, what, e)
            damaged.append(what)
            return empty

    if not isinstance(part(RUN_JSON, store.read_run_json, {}), dict):
        damaged.append(RUN_JSON)  # valid JSON, but not the object a run.json is
    rows, bad_rows = part("metrics", store.scan_metrics, ([], []))
    versions = part("weights", store.committed_versions, [])
    lease = part(LEASE_JSON, lambda: lease_text(store, time.time()), f"damaged {LEASE_JSON}")
    serving, bad_serving = part("engines", store.scan_serving, ({}, []))
    return RunState(
        name=name,
        iterations=len(rows),
        newest_version=versions[-1] if versions else None,
        lease=lease,
        serving=serving,
        damaged=(*damaged, *bad_rows, *bad_serving),
    )


def list_runs(cfg: StorageConfig) -> list[RunState]:
    """Every run under ``cfg.root`` (a folder with a run.json), by name."""
    runs = (read_run(cfg, name) for name in _folders(cfg))
    return [r for r in runs if r is not None]


def table(runs: list[RunState]) -> str:
    """One line per run, for a terminal; a last column names damaged files, if any."""
    if not runs:
        return "no runs (no folder with a run.json)"
    rows = [("run", "iterations", "newest", "lease", "engines (version served)", "damaged")]
    for r in runs:
        engines = ", ".join(f"e{e}=v{v}" for e, v in sorted(r.serving.items())) or "-"
        newest = "-" if r.newest_version is None else f"v{r.newest_version}"
        damaged = ", ".join(r.damaged) or "-"
        rows.append((r.name, str(r.iterations), newest, r.lease, engines, damaged))
    if not any(r.damaged for r in runs):
        rows = [row[:5] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in rows
    )

"""Prefect artifacts of a run: a metrics table per iteration, a progress bar,
a markdown summary and the reward curve (PNG, embedded as a data URL)."""

from __future__ import annotations

import base64
import contextvars
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows.report import reward_curve_png, summary_markdown


class Reporter:
    """Creates artifacts on one background thread, in order, so that the API calls
    (~10-20 ms each) stay off the iteration's critical path. Each call runs in
    the caller's Prefect context (the flow run it belongs to); ``close`` waits for
    all of them and raises the first failure. Only calls not yet checked are
    kept (two a submit would otherwise add up over a long run)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artifacts")
        self._futures: list[Future] = []
        self._failure: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._settle(done_only=True)
        ctx = contextvars.copy_context()
        self._futures.append(self._pool.submit(ctx.run, fn, *args))

    def pending(self) -> int:
        """Calls kept: those submitted and not yet found finished."""
        return len(self._futures)

    def _settle(self, done_only: bool) -> None:
        """Forget finished calls, keeping the first failure for ``close``."""
        kept = []
        for f in self._futures:
            if done_only and not f.done():
                kept.append(f)
            elif self._failure is None and f.exception() is not None:
                self._failure = f.exception()
        self._futures = kept

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._settle(done_only=False)
        if self._failure is not None:
            raise self._failure

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def artifact_key(run: str, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run}-{what}".lower()).strip("-")


def iteration_table(run: str, k: int, row: dict[str, Any]) -> None:
    table = [{"metric": key, "value": value} for key, value in row.items()]
    create_table_artifact(
        table=table, key=artifact_key(run, "metrics"), description=f"{run}: iteration {k}"
    )


def start_progress(run: str, done: int, total: int) -> UUID:
    return create_progress_artifact(
        progress=100.0 * done / max(total, 1),
        key=artifact_key(run, "progress"),
        description=f"{run}: iterations done",
    )


def update_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, progress=100.0 * done / max(total, 1))


def run_summary(ctx, rows: list[dict[str, Any]], step_seconds: dict[str, float]) -> None:
    store, run = ctx.store, ctx.run_name
    all_rows = store.read_metrics()
    md = summary_markdown(
        run, store.url, rows, store.committed_versions(), step_seconds, store.serving_versions()
    )
    if all_rows:
        png = reward_curve_png(all_rows, f"{run}: mean reward")
        store.fs.makedirs(f"{store.url}/reports", exist_ok=True)
        store.fs.pipe_file(f"{store.url}/reports/reward_curve.png", png)
        data_url = "data:image/png;base64," + base64.b64encode(png).decode()
        create_image_artifact(
            image_url=data_url,
            key=artifact_key(run, "reward-curve"),
            description=f"{run}: reward curve",
        )
        md += f"\n\n## Reward curve\n\n![reward curve]({data_url})\n\nAlso at `{store.url}/reports/reward_curve.png`."
    create_markdown_artifact(
        markdown=md, key=artifact_key(run, "summary"), description=f"{run}: run summary"
    )

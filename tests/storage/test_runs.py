"""``prefect-rl runs``: each run is read on its own, so a damaged run is listed with
what is damaged and never hides the healthy runs beside it."""

from __future__ import annotations

import pytest

from storage import RunStore, StorageConfig, StorageError
from storage.runs import list_runs, table


def _healthy(cfg: StorageConfig) -> None:
    ok = RunStore(cfg, "ok")
    ok.write_run_json({"config": {}})
    for k in (1, 2):
        ok.append_metrics(k, {"reward_mean": 0.5})
    ok.record_serving(0, 2)
    ok.acquire_lease("otherhost:12", 60)


def _damaged_run(cfg: StorageConfig) -> RunStore:
    bad = RunStore(cfg, "bad")
    bad.write_run_json({"config": {}})
    bad.append_metrics(1, {"reward_mean": 0.1})
    bad.record_serving(0, 1)
    return bad


# (what is damaged, the run-relative object and its bytes, what the listing shows)
CASES = {
    "torn run.json": ("run.json", b'{"config": {', "run.json"),
    "run.json not an object": ("run.json", b"[1, 2]", "run.json"),
    "torn lease.json": ("lease.json", b'{"owner": "a', "lease.json"),
    "lease.json of another shape": ("lease.json", b'{"owner": 3}', "lease.json"),
    "torn metrics row": ("metrics/iter_000002.json", b'{"iteration": 2, "rew', "iter_000002"),
    "metrics row without iteration": ("metrics/iter_000002.json", b'{"r": 1}', "iter_000002"),
    "engine record that is a list": ("engines/engine_001.json", b"[1]", "engine_001"),
    "engine record without version": ("engines/engine_001.json", b"{}", "engine_001"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_run_is_listed_with_its_damage_beside_the_healthy_one(tmp_path, case):
    _check_listing(StorageConfig(root=str(tmp_path / "runs")), case)


def test_a_torn_lease_and_a_stray_object_on_each_backend(cfg):
    """An object beside the run prefixes, and a torn lease, on S3 as on disk."""
    _check_listing(cfg, "torn lease.json")


def _check_listing(cfg: StorageConfig, case: str) -> None:
    _healthy(cfg)
    bad = _damaged_run(cfg)
    rel, blob, shown = CASES[case]
    bad.fs.pipe_file(f"{bad.url}/{rel}", blob)
    # A plain file beside the runs (a log) is no run and no error.
    fs = bad.fs
    fs.pipe_file(f"{bad.url.rsplit('/', 1)[0]}/log", b"a log line\n")

    runs = {r.name: r for r in list_runs(cfg)}

    assert set(runs) == {"ok", "bad"}
    ok = runs["ok"]
    assert (ok.iterations, ok.serving, ok.lease, ok.damaged) == (
        2,
        {0: 2},
        "held by otherhost:12 (live)",
        (),
    )
    damaged = runs["bad"]
    assert any(shown in d for d in damaged.damaged), damaged
    if rel == "lease.json":
        assert damaged.lease == "damaged lease.json"
    else:  # what did read is still shown
        assert damaged.lease == "free"
        assert damaged.iterations == 1  # iteration 2 of the metrics cases is the torn row
        assert damaged.serving == {0: 1}
    text = table(list(runs.values()))
    assert "damaged" in text.splitlines()[0] and shown in text


def test_the_run_itself_still_names_a_damaged_record(store):
    """The listing tolerates damage; the run's own reads refuse it, naming the object."""
    store.append_metrics(1, {"reward_mean": 0.5})
    store.fs.pipe_file(f"{store.url}/metrics/iter_000002.json", b'{"r": 1}')
    with pytest.raises(StorageError, match=r"metrics/iter_000002.json is damaged.*delete it"):
        store.read_metrics()
    store.record_serving(0, 1)
    store.fs.pipe_file(f"{store.url}/engines/engine_000.json", b"[0]")
    with pytest.raises(StorageError, match=r"engine_000.json is damaged.*reload"):
        store.serving_versions()


def test_an_empty_or_missing_root_lists_no_runs(tmp_path):
    cfg = StorageConfig(root=str(tmp_path / "nothing-here"))
    assert list_runs(cfg) == []
    assert "no runs" in table([])

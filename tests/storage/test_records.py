import threading

import pytest

from storage import RunStore, StorageError, VersionConflictError


def test_ledger_records(store):
    assert store.read_record(1, "train") is None and store.committed_steps(1) == []
    store.write_record(1, "rollout", {"n": 8, "url": "x"})
    store.write_record(1, "train", {"loss": 0.5})
    store.write_record(1, "train", {"loss": 0.5})  # identical: no-op
    with pytest.raises(VersionConflictError, match="read_record"):
        store.write_record(1, "train", {"loss": 0.7})
    store.write_record(1, "train", {"loss": 0.7}, overwrite=True)
    assert store.read_record(1, "train") == {"loss": 0.7}
    assert store.committed_steps(1) == ["rollout", "train"]
    with pytest.raises(StorageError, match="plain name"):
        store.write_record(1, "../x", {})


def test_metrics_sorted_and_jsonl(store):
    store.append_metrics(2, {"reward": 0.2})
    store.append_metrics(1, {"reward": 0.1})
    assert store.read_metrics() == [
        {"iteration": 1, "reward": 0.1},
        {"iteration": 2, "reward": 0.2},
    ]
    jsonl = store.fs.cat_file(store.url + "/metrics.jsonl").decode().splitlines()
    assert len(jsonl) == 2 and '"iteration": 1' in jsonl[0]
    with pytest.raises(StorageError, match="NaN"):
        store.append_metrics(3, {"reward": float("nan")})


def test_two_concurrent_appenders_lose_no_lines(cfg):
    a, b = RunStore(cfg, "run1"), RunStore(cfg, "run1")
    n = 6
    errors = []

    def go(store, ks):
        try:
            for k in ks:
                store.append_metrics(k, {"who": k % 2})
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [
        threading.Thread(target=go, args=(a, range(0, n, 2))),
        threading.Thread(target=go, args=(b, range(1, n, 2))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [r["iteration"] for r in a.read_metrics()] == list(range(n))
    lines = a.fs.cat_file(a.url + "/metrics.jsonl").decode().splitlines()
    assert len(lines) == n


def test_serving_records(store):
    assert store.serving_versions() == {}
    store.record_serving(0, 3)
    store.record_serving(1, 2)
    store.record_serving(0, 4)
    assert store.serving_versions() == {0: 4, 1: 2}


def test_serving_record_already_on_the_version_is_not_rewritten(store):
    """Each step that needs an engine on v records it; only a change is written (a synced
    file on the iteration's critical path), and a damaged record is written again."""
    path = store.url + "/engines/engine_000.json"
    store.record_serving(0, 3)
    first = store.fs.cat_file(path)
    store.record_serving(0, 3)
    assert store.fs.cat_file(path) == first  # same bytes: its updated_at was not touched
    store.record_serving(0, 4)
    assert store.serving_versions() == {0: 4}
    store.fs.pipe_file(path, b"{torn")
    store.record_serving(0, 4)
    assert store.serving_versions() == {0: 4}
